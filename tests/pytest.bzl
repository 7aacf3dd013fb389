"""`pytest_test`: a py_test that runs its pytest files in one process through tests/pytest_main.py."""

def pytest_test(name, srcs, deps = [], data = [], tags = [], size = "small", **kwargs):
    native.py_test(
        name = name,
        srcs = ["//tests:pytest_main.py"] + srcs,
        main = "//tests:pytest_main.py",
        args = ["$(location %s)" % src for src in srcs],
        deps = deps + ["//:tfdist", "//:benchmarks", "//tests:helpers"],
        data = data + ["//:configs"],
        python_version = "PY3",
        tags = tags,
        size = size,
        **kwargs
    )
