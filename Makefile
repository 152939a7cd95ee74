# Two set-up commands: `make run` (the main job on the bundled defaults) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mmspec-installed

.PHONY: run test install bench bench-ar-image assets clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/mmspec showcase

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/mmspec bench core --json bench-core.json

bench-ar-image: $(STAMP)
	$(BIN)/mmspec bench ar-image --json bench-ar-image.json

# rebuild every bundled checkpoint from its seed (about 50 min on 2 cores); model_index.json is static
AR := assets/ar-image
assets: $(STAMP)
	$(BIN)/mmspec train vq --out $(AR)/vqvae
	$(BIN)/mmspec train ar-image --vq $(AR)/vqvae --out $(AR)/transformer
	$(BIN)/mmspec train ar-draft --kind chain --vq $(AR)/vqvae --out $(AR)/draft_model
	$(BIN)/mmspec train ar-draft --kind eagle --target $(AR)/transformer --vq $(AR)/vqvae --out $(AR)/eagle_head
	$(BIN)/mmspec train classifier --out assets/classifier

clean:
	rm -rf $(VENV) build *.egg-info
