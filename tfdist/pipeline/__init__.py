"""Pipeline parallelism (issue 22): models split into stages (`split`)."""
