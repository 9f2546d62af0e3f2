.PHONY: setup test test-fast lint demo clean images

VENV := .venv
PY := $(VENV)/bin/python

setup:
	@bash scripts/setup.sh

# The whole suite: unit, protocol, transfer engines over loopback, decode node, vLLM on CPU. The
# slowest tests are listed at the end: the suite's time budget on a 2-core CI box is tight.
test: setup
	@$(PY) -m pytest -q -ra --durations=25 $(PYTEST_ARGS)

# Everything but the tests that start vLLM.
test-fast: setup
	@$(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff check tilert_serve operator tests bench
	@$(VENV)/bin/ruff format --check tilert_serve operator tests bench scripts
	@$(VENV)/bin/lint-imports
	@$(VENV)/bin/mypy

# DEMO_ARGS=--runtime=docker: the same demo from the images (a Docker engine and `make images` first).
demo: setup
	@case "$(DEMO_ARGS)" in *docker*) bash scripts/docker-engine.sh && bash scripts/images.sh ;; esac
	@$(PY) -m tilert_serve.local.demo $(DEMO_ARGS)

# The operator image and the two CPU images (docker/images.txt), from the pinned public bases when they
# can be pulled, else from an offline Debian base; a second run with nothing changed is all cache hits.
images:
	@bash scripts/images.sh $(IMAGES)

clean:
	rm -rf $(VENV) .pytest_cache
