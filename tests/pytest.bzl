"""`pytest_test`: a py_test that runs one pytest file through tests/pytest_main.py."""

def pytest_test(name, src, deps = [], data = [], tags = [], size = "small", **kwargs):
    native.py_test(
        name = name,
        srcs = ["//tests:pytest_main.py", src],
        main = "//tests:pytest_main.py",
        args = ["$(location %s)" % src],
        deps = deps + ["//:tfdist", "//tests:helpers"],
        data = data + ["//:configs"],
        python_version = "PY3",
        tags = tags,
        size = size,
        **kwargs
    )
