# The two commands of the README:
#   make run    the main job: a short stress run on the built-in default config
#   make test   the test suite
# Both first install whatever is missing (see `setup`), so they work on a fresh
# Debian machine. Override PYTHON to use another interpreter.

PYTHON ?= python3
# torch is installed only when it is not importable (or older than 2.9, the oldest
# tiermem works with), pinned to the CPU wheel: an unpinned `torch`, or pip upgrading
# an old one to meet pyproject's floor, pulls a multi-GB CUDA build onto machines
# without a GPU.
TORCH_SPEC ?= torch==2.13.0
TORCH_OK := import torch; v = torch.__version__.split("+")[0].split("."); \
	raise SystemExit((int(v[0]), int(v[1])) < (2, 9))
PYTEST_ARGS ?=
export PIP_ROOT_USER_ACTION := ignore
STAMP := build/.installed
ISTAMP := build/.integrations
NATIVE := $(wildcard native/*.c native/*.h) native/build_native.py setup.py pyproject.toml

.PHONY: setup run test test-full clean
setup: $(STAMP)

$(STAMP): $(NATIVE)
	@if [ -z "$$TIERMEM_LIBURING_PREFIX" ] && [ ! -e /usr/include/liburing.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "setup: installing liburing-dev"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev; \
	  else \
	    echo "setup: liburing-dev is missing; install it (sudo apt-get install liburing-dev) and rerun"; \
	    exit 1; \
	  fi; \
	fi
	@$(PYTHON) -c '$(TORCH_OK)' 2>/dev/null || { echo "setup: installing $(TORCH_SPEC)"; \
	  $(PYTHON) -m pip install -q "$(TORCH_SPEC)"; }
	@$(PYTHON) -m pip install -q "setuptools>=77" wheel "cffi>=1.15"
	@echo "setup: building tiermem (native io_uring engine) and its test extras"
	@$(PYTHON) -m pip install -q --no-build-isolation -e ".[test]"
	@mkdir -p build && touch $(STAMP)

# The framework integrations' tests run against the real packages (lightning, accelerate,
# transformers); pinning the installed torch keeps pip from swapping in a CUDA build.
$(ISTAMP): $(STAMP)
	@echo "setup: installing the integrations and third-party optimizer extras (lightning, accelerate, transformers; lion-pytorch, torch-optimizer, pytorch-optimizer, schedulefree, bitsandbytes, torchao, adam-atan2-pytorch, came-pytorch, prodigyopt)"
	@$(PYTHON) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > build/torch-constraint.txt
	@# the extras' requirements from pyproject.toml, not `pip install -e ".[...]"`: that
	@# would build tiermem's native library a second time (a minute on a 2-core machine)
	@$(PYTHON) -c 'import sys; tomllib = __import__("tomllib" if sys.version_info >= (3, 11) else "pip._vendor.tomli", fromlist=["load"]); x = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print("\n".join(x["test"] + x["integrations"] + x["thirdparty"]))' > build/extras.txt
	@$(PYTHON) -m pip install -q --no-build-isolation -c build/torch-constraint.txt -r build/extras.txt
	@touch $(ISTAMP)

# 500M fp32 parameters: 4 GB of optimizer state, 2 GiB of it in the default host
# tier and the rest streamed from ~/.cache/tiermem/swap; every step verified.
STRESS_ARGS ?= --params 500M --steps 3 --synthetic-grads --verify
run: setup
	$(PYTHON) -m tiermem stress $(STRESS_ARGS)

test: setup $(ISTAMP)
	$(PYTHON) -c "from importlinter.cli import lint_imports_command as c; c()"   # the layer contracts in pyproject.toml
	$(PYTHON) -m pytest -q $(PYTEST_ARGS) tests

# The full tier: every sweep's whole cross (each case on both I/O backends) and the tests
# marked long (docs/dev/testing.md, "Two tiers").
test-full: setup $(ISTAMP)
	$(PYTHON) -c "from importlinter.cli import lint_imports_command as c; c()"
	TIERMEM_FULL_SWEEP=1 $(PYTHON) -m pytest -q $(PYTEST_ARGS) tests

clean:
	rm -rf build tiermem/_native*.so tiermem/_native.c tiermem/_native.o *.egg-info
