# Set-up is idempotent: each step leaves a stamp and is skipped when it is there.
PYTHON ?= python3
VENV   := .venv
BIN    := $(abspath $(VENV))/bin
STAMPS := $(VENV)/.stamps
PYTEST_ARGS ?=

export PATH := $(BIN):$(PATH)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup demo test pytest bazel-test docs site site-look bench clean

setup: $(STAMPS)/tfdist $(STAMPS)/system $(STAMPS)/horovod

# The virtual environment and tfdist with its CPU TensorFlow and test tools.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

# keras-hub and tensorflow-text without their dependencies: both ask for `tensorflow`, which would
# install beside tensorflow-cpu (pyproject.toml's `hub` extra has the rest).
HUB_PACKAGES := keras-hub==0.32.0 tensorflow-text==2.21.1
$(STAMPS)/tfdist: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[cpu,monitor,plots,test,k8s,docs,hub]"
	$(BIN)/pip install --quiet --no-deps $(HUB_PACKAGES)
	mkdir -p $(STAMPS) && touch $@

# Debian packages: Bazel for `bazel test //...`; cmake and the headers that
# TensorFlow's XLA headers include, and Open MPI (Horovod's MPI controller, which Adasum needs);
# Slurm and munge, which the tests start as a real one-node cluster; ip, tc and sshd, which make
# the network-namespace hosts of `tfdist launch --hosts` (horovodrun reaches them by ssh); acct, whose
# process accounting counts the processes `make test` starts.
SYSTEM_PACKAGES := bazel-bootstrap cmake libhighwayhash-dev libfarmhash-dev libopenmpi-dev openmpi-bin \
                   slurm-wlm munge openssh-server iproute2 acct
$(STAMPS)/system: Makefile | $(BIN)/python
	dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q $(SYSTEM_PACKAGES); }
	mkdir -p $(STAMPS) && touch $@

# Horovod, built once per TensorFlow version and cached outside the repo.
$(STAMPS)/horovod: $(STAMPS)/tfdist tools/install_horovod.sh | $(STAMPS)/system
	tools/install_horovod.sh $(BIN)
	mkdir -p $(STAMPS) && touch $@

demo: setup
	tfdist train --config configs/default.yaml

# `bazel test //...` runs the unit-test files of tests/BUILD; pytest runs the rest, so no test runs twice.
BAZEL_TESTS = $(shell $(PYTHON) tools/bazel_unit_tests.py)

# Every time limit of the suite is set for the slowest machine kind CI uses and scaled by this machine's slowness
# against it, measured once here (tests/machine_speed.py) and inherited by pytest, Bazel's tests and their jobs.
# Bazel's unit tests run beside pytest at the lowest CPU priority: they take the cycles pytest's
# multi-process tests leave idle while their processes start and wait on each other, so they add
# little to the wall time and nothing to pytest's timings. Starved that way a unit test can take
# several times its own time, hence Bazel's long timeout. Three at a time: a unit-test shard keeps about
# two thirds of a core busy (its devices' threads wait on each other), so two left idle cycles once pytest
# had ended. Bazel's output is shown when pytest has
# finished; either failing fails `make test`. The run ends with a summary (tools/test_summary.py):
# the times, the slowest tests and, where process accounting can be switched on (root), how many
# processes of TensorFlow's size were started and how many forked from the test zygote, and the
# tests of most CPU (each test's own process logs its CPU; the zygote logs which test asked for each child).
# A whole run then checks the tables of docs/own-script.md and docs/optimizers.md against its results
# (tools/own_script_table.py, tools/optimizer_table.py).
BAZEL_LOG := bazel-test.log
RESULTS := .test-results
test: setup
	$(MAKE) site
	@rm -rf $(RESULTS) && mkdir -p $(RESULTS) && touch $(RESULTS)/pacct; \
	accton $(abspath $(RESULTS))/pacct >/dev/null 2>&1 || true; \
	export TFDIST_TEST_SLOWNESS=$$(python tests/machine_speed.py); \
	echo "Time limits x$$TFDIST_TEST_SLOWNESS (this machine's slowness, tests/machine_speed.py)"; \
	start=$$(date +%s); \
	( nice -n 19 bazel --batch test --test_timeout=3600 --test_env=TFDIST_TEST_SLOWNESS --jobs=3 \
	      --local_test_jobs=3 //... > $(BAZEL_LOG) 2>&1; status=$$?; \
	  echo $$(( $$(date +%s) - start )) > $(RESULTS)/bazel_seconds; exit $$status ) & bazel_pid=$$!; \
	trap 'kill $$bazel_pid 2>/dev/null; accton off >/dev/null 2>&1' INT TERM; \
	export TFDIST_TEST_ZYGOTE_REFUSALS=$(abspath $(RESULTS))/zygote-refusals.jsonl; \
	export TFDIST_TEST_ZYGOTE_FORKS=$(abspath $(RESULTS))/zygote-forks.jsonl; \
	export TFDIST_TEST_CPU_LOG=$(abspath $(RESULTS))/test-cpu.jsonl; \
	$(MAKE) pytest PYTEST_ARGS="--junitxml=$(RESULTS)/pytest.xml $(addprefix --ignore=,$(BAZEL_TESTS)) $(PYTEST_ARGS)"; \
	pytest_status=$$?; pytest_seconds=$$(( $$(date +%s) - start )); \
	wait $$bazel_pid; bazel_status=$$?; accton off >/dev/null 2>&1; \
	echo "=== bazel test //... (ran beside pytest) ==="; cat $(BAZEL_LOG); \
	python tools/test_summary.py --pytest_seconds $$pytest_seconds --bazel_seconds $$(cat $(RESULTS)/bazel_seconds) \
	    --total_seconds $$(( $$(date +%s) - start )) --junit $(RESULTS)/pytest.xml --accounting $(RESULTS)/pacct \
	    --refusals $(RESULTS)/zygote-refusals.jsonl --forks $(RESULTS)/zygote-forks.jsonl \
	    --cpu_log $(RESULTS)/test-cpu.jsonl; \
	table_status=0; [ -n "$(PYTEST_ARGS)" ] || for table in own_script_table optimizer_table; do \
	    python tools/$$table.py --junit $(RESULTS)/pytest.xml --check || table_status=1; done; \
	[ $$pytest_status -eq 0 ] && [ $$bazel_status -eq 0 ] && [ $$table_status -eq 0 ]

# Two pytest-xdist workers: most of a multi-process test's time is its processes starting,
# connecting and waiting, which the other worker's test fills. Tests that share a machine-wide
# resource (the namespace hosts, the one local Slurm) are an xdist_group each, on one worker.
PYTEST_WORKERS ?= 2
pytest:
	TFDIST_REQUIRE_HOROVOD=1 pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

bazel-test:
	bazel test --test_output=errors //...

# `make docs` rewrites the config reference from the schema's docstrings and the table of patches to Keras
# from their registry (a test fails when either committed one is stale), then builds the site; `make site`
# only builds it. The build is strict: a broken link, or a page missing from mkdocs.yml, fails it.
docs: $(STAMPS)/tfdist
	python tools/config_reference.py
	python tools/patches_table.py
	$(MAKE) site

site: $(STAMPS)/tfdist
	mkdocs build --strict --quiet --site-dir .site

# Every page in headless Chromium at a desktop and a phone width: tables wider than their column, pages that
# scroll sideways, images that did not load; with a PNG of each page's first screen in .site-look/.
site-look: $(STAMPS)/tfdist
	command -v chromium >/dev/null || apt-get install -y -q chromium
	python tools/site_look.py --screenshots .site-look

bench: setup
	OMP_NUM_THREADS=1 tfdist bench overhead --json results/overhead.json --repeats 9
	OMP_NUM_THREADS=1 tfdist bench checkpoint --json results/checkpoint.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench pipeline --json results/pipeline.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench parameter_server --json results/parameter_server.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench ps_worker_loss --json results/ps_worker_loss.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench horovod --json results/horovod.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench data_parallel_pipeline --json results/data_parallel_pipeline.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench tensor_parallel --json results/tensor_parallel.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench layout --json results/layout.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench sharded_optimizer --json results/sharded_optimizer.json --repeats 7
	OMP_NUM_THREADS=1 tfdist bench network --json results/network.json --plot results/network.png --repeats 3
	OMP_NUM_THREADS=1 tfdist bench network --model sparse_embedding --json results/network_sparse.json \
		--plot results/network_sparse.png --repeats 3
	OMP_NUM_THREADS=1 tfdist bench plan --links 100mbit,1gbit,10gbit --repeats 5 --json results/plan.json
	OMP_NUM_THREADS=1 tfdist bench plan --kinds pipeline,tensor_parallel --repeats 5 --json results/plan_one_process.json
	tfdist bench plan_published --json results/plan_published.json
	tfdist bench input_pipeline --json results/input_pipeline.json --repeats 5
	tfdist bench scaling --config configs/default.yaml --json results/scaling.json --plot results/scaling.png --repeats 3
	OMP_NUM_THREADS=1 tfdist bench baselines --json results/baselines.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench precision --json results/precision.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench synthetic --model keras.applications.MobileNetV2 --image_size 64 --batch_per_device 32 \
	    --json results/synthetic.json --plot results/synthetic.png --repeats 5

clean:
	rm -rf $(VENV) bazel-* .pytest_cache .site
