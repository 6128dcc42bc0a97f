"""The compat patches that act as a process starts (tfdist/compat/), each in
fresh Python processes (the checks of each patch: tests/unit/test_compat.py)."""


def test_keras_imports_matplotlib_only_when_a_plot_needs_it(tmp_path):
    """With tfdist imported first, `import tensorflow` and `import keras` leave
    matplotlib out (0.4-0.5 CPU-s per process) and Keras's galleries still plot
    (pyplot and patches); the control, TensorFlow imported first, shows Keras
    importing matplotlib by itself."""
    import subprocess
    import sys
    png = str(tmp_path / "gallery.png")
    deferred = ("import sys, tfdist, tensorflow, keras, numpy\n"
                "assert not [m for m in sys.modules if m.startswith('matplotlib')], 'imported'\n"
                "keras.visualization.plot_image_gallery(numpy.zeros((2, 4, 4, 3)), path=sys.argv[1])\n"
                "from keras.src.visualization import plot_bounding_box_gallery as boxes\n"
                "assert boxes.patches.Patch   # (plotting boxes needs OpenCV too)\n"
                "assert 'matplotlib.pyplot' in sys.modules and 'matplotlib.patches' in sys.modules\n")
    control = "import sys, tensorflow, tfdist; assert 'matplotlib.pyplot' in sys.modules"
    procs = [subprocess.Popen([sys.executable, "-c", code, png], stderr=subprocess.PIPE, text=True)
             for code in (deferred, control)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
