"""Pipeline parallelism: models split into stages (`split`)."""
