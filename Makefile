# Two set-up commands: `make run` (the main job on the bundled defaults) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mmspec-installed

.PHONY: run test test-slow test-all test-fast install docs demo bench bench-ar-image bench-vlm bench-kernels bench-video assets clean gpu-check gpu-wheels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,docs]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/mmspec showcase

# the fast tier on two pytest-xdist workers (each test runs torch on one thread: tests/conftest.py);
# the slow tier (tests/slow_tier.txt and @pytest.mark.slow: statistical laws, trainings, child
# processes, timing, memory) is `make test-slow`; CI (.ci/run) runs both, `make test-all` too
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m ""

# everything but the slow, statistical, browser and GPU tests (markers in pyproject.toml), on two workers
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not statistical and not browser and not gpu and not cuda"

# the docs site (MkDocs + Material, API pages from docstrings) into site/; strict: a broken link fails
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# the Gradio demo on http://127.0.0.1:7860 (mmspec demo --host 0.0.0.0 to serve beyond this machine)
demo: $(STAMP)
	$(BIN)/mmspec demo

bench: $(STAMP)
	$(BIN)/mmspec bench core --json bench-core.json

bench-ar-image: $(STAMP)
	$(BIN)/mmspec bench ar-image --json bench-ar-image.json

bench-vlm: $(STAMP)
	$(BIN)/mmspec bench vlm --json bench-vlm.json

# the kernels against their references (in Triton's interpreter without a GPU; on a GPU also at GPU shapes)
bench-kernels: $(STAMP)
	$(BIN)/mmspec bench kernels --json bench-kernels.json

# 100, 1,000 and 10,000 frames per cache mode, the window sweep and the prompt switches
bench-video: $(STAMP)
	$(BIN)/mmspec bench video --json bench-video.json

# the prepared GPU check (at most 9 minutes on a CUDA machine; report in $(OUT) or gpu-check-out):
#   here:             make gpu-wheels     (diffusers, transformers, importlib_metadata, setuptools for the
#                                          editable install: Python 3.12 wheels in .whl/)
#   on the GPU:       make gpu-check      (python3 with its own torch and triton; installs .whl/ and mmspec)
#   here, no GPU:     make gpu-check DRY_RUN=1   (the same driver, every CUDA step reported as skipped)
#   some steps only:  make gpu-check STEPS="pipeline:vlm vlm-heavy"
ifeq ($(DRY_RUN),1)
gpu-check: $(STAMP)
	DRY_RUN=1 bash scripts/gpu_check.sh
else
gpu-check:
	bash scripts/gpu_check.sh
endif

WHEEL_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir .whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(WHEEL_PLATFORMS) -d .whl $$($(BIN)/python -c "import importlib.metadata as m; \
	  print(' '.join(f'{p}=={m.version(p)}' for p in ('diffusers', 'transformers', 'importlib_metadata', 'setuptools')))")
	echo "$$(git rev-parse HEAD)$$(git diff --quiet HEAD -- . ':!.whl' || echo ' dirty')" > .whl/COMMIT
	ls -l .whl

# rebuild every bundled checkpoint from its seed (about 3 h on 2 cores); model_index.json files and
# assets/vlm/processor (a copy of the target recipe's processor files) are static
AR := assets/ar-image
VLM := assets/vlm
CONT := assets/continuous
assets: $(STAMP)
	$(BIN)/mmspec train vq --out $(AR)/vqvae
	$(BIN)/mmspec train ar-image --vq $(AR)/vqvae --out $(AR)/transformer
	$(BIN)/mmspec train ar-draft --kind chain --vq $(AR)/vqvae --out $(AR)/draft_model
	$(BIN)/mmspec train ar-draft --kind eagle --target $(AR)/transformer --vq $(AR)/vqvae --out $(AR)/eagle_head
	$(BIN)/mmspec train ar-draft --kind medusa --target $(AR)/transformer --vq $(AR)/vqvae --out $(AR)/medusa_head --threads 1
	$(BIN)/mmspec train classifier --out assets/classifier
	$(BIN)/mmspec train video-ae --out assets/video/vae
	$(BIN)/mmspec train video --ae assets/video/vae --out assets/video/transformer
	$(BIN)/mmspec train video-judge --out assets/video_judge --threads 1
	$(BIN)/mmspec train vlm --size target --out $(VLM)/target
	cp $(VLM)/target/processor_config.json $(VLM)/target/tokenizer.json $(VLM)/target/tokenizer_config.json $(VLM)/processor/
	# the 16 held-out scenes the demo and mmspec.serve.scene show (data, not weights: runtime draws none)
	$(BIN)/python -c "from mmspec.training.recipes.vlm import save_heldout_scenes; save_heldout_scenes('$(VLM)/scenes')"
	$(BIN)/mmspec train vlm --size draft --out $(VLM)/draft_model
	$(BIN)/mmspec train vlm-draft --method eagle --target $(VLM)/target --out $(VLM)/eagle_head
	$(BIN)/mmspec train vlm-draft --method specvlm --target $(VLM)/target --out $(VLM)/specvlm_head
	$(BIN)/mmspec train vlm-draft --method vispec --target $(VLM)/target --out $(VLM)/vispec_head
	$(BIN)/mmspec train vlm-draft --method medusa --target $(VLM)/target --out $(VLM)/medusa_head
	# the visual-heavy VLM (192 px, 576 visual tokens an image, 1 to 4 images a prompt): the 64 px target and
	# heads fine-tuned at 192 px (build/vlm-hd1), then on prompts of 1 to 4 images asked about the last
	$(BIN)/mmspec train vlm --size target --resolution 192 --init $(VLM)/target --steps 240 --batch-size 16 \
	  --lr 3e-4 --warmup 20 --dataset-size 3840 --out build/vlm-hd1/target
	for m in eagle specvlm vispec medusa; do $(BIN)/mmspec train vlm-draft --method $$m --target build/vlm-hd1/target \
	  --init $(VLM)/$${m}_head --steps 120 --batch-size 8 --lr 3e-4 --dataset-size 1920 --tau-tokens 16 \
	  --out build/vlm-hd1/$${m}_head || exit 1; done
	$(BIN)/mmspec train vlm --size target --resolution 192 --images-per-prompt 4 --init build/vlm-hd1/target \
	  --steps 200 --batch-size 8 --lr 3e-4 --warmup 15 --dataset-size 1600 --out $(VLM)-hd/target
	cp $(VLM)-hd/target/processor_config.json $(VLM)-hd/target/tokenizer.json $(VLM)-hd/target/tokenizer_config.json \
	  $(VLM)-hd/target/chat_template.jinja $(VLM)-hd/processor/
	for m in eagle specvlm vispec medusa; do $(BIN)/mmspec train vlm-draft --method $$m --target $(VLM)-hd/target \
	  --init build/vlm-hd1/$${m}_head --steps 120 --batch-size 8 --lr 3e-4 --dataset-size 960 \
	  --out $(VLM)-hd/$${m}_head || exit 1; done
	$(BIN)/mmspec train continuous-tokenizer --out $(CONT)/tokenizer --classifier assets/classifier
	$(BIN)/mmspec train continuous-ar --tokenizer $(CONT)/tokenizer --out $(CONT)/transformer --threads 2
	# the two drafts side by side, one thread each (59.3 min from the tokenizer on, measured 2026-11-28)
	$(BIN)/mmspec train continuous-draft --tokenizer $(CONT)/tokenizer --target $(CONT)/transformer --out $(CONT)/draft_model --threads 1 & pid=$$!; \
	$(BIN)/mmspec train continuous-draft --tokenizer $(CONT)/tokenizer --target $(CONT)/transformer --distill 0.5 --steps 2500 --out $(CONT)/draft_distilled --threads 1 && wait $$pid

clean:
	rm -rf $(VENV) build *.egg-info
