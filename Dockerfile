# kvwire's core pipeline (schemas, producer, consumer, CLI) for the compose `index` and `demo`
# services. The LMCache/vLLM extras are not installed: they belong in the engine's own image, next
# to the connector they wrap.
#
# Two stages: the builder compiles the wheel (and the Rust extension under rust/, through
# setuptools-rust) into a venv; the runtime stage gets only that venv. The Rust toolchain is
# Debian bookworm's own rustc-web/cargo-web (1.85 in bookworm, 1.96 in bookworm-security): recent
# enough for pyo3 0.27, and installable from Debian's archive where no rustup download is possible.
# It is installed only when pyproject.toml asks for setuptools-rust.
#
# KVWIRE_WHEELS=<dir in the context> skips that compile: the builder installs the kvwire wheel
# found there instead (same commit, built on the host by `pip wheel --no-deps .`, whose cargo
# reuses the release build of `pip install -e .`). CI does this to stay inside its time budget
# (.ci/containers.sh); `docker compose build` and `kvwire kafka image --app .` build from source.
#
# BASE is any Debian bookworm image with or without Python: python:3.11-slim-bookworm (the default,
# for engines that reach a registry) or the debootstrap-made localhost/kvwire-base:bookworm that
# `kvwire kafka image --app .` builds with (no registry needed; Debian's python3 is 3.11 too).
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG KVWIRE_WHEELS=
COPY pyproject.toml /src/pyproject.toml
RUN set -eu; pkgs=""; \
    command -v python3 >/dev/null || pkgs="python3 python3-venv"; \
    if [ -z "$KVWIRE_WHEELS" ] && grep -q setuptools-rust /src/pyproject.toml; then pkgs="$pkgs rustc-web cargo-web"; fi; \
    if [ -n "$pkgs" ]; then \
      apt-get update; DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/kvwire
# Dependencies first, from pyproject.toml alone: a source change rebuilds only kvwire itself.
# The cache mounts keep pip's downloads and cargo's registry and target dir across builds.
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -c "import tomllib; print(*tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" >/tmp/deps.txt \
 && /opt/kvwire/bin/pip install -r /tmp/deps.txt
COPY . /src
ENV CARGO_TARGET_DIR=/cargo-target
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=cache,target=/root/.cargo/registry \
    --mount=type=cache,target=/cargo-target \
    if [ -n "$KVWIRE_WHEELS" ]; then \
      /opt/kvwire/bin/pip install --no-deps --no-index --find-links "/src/$KVWIRE_WHEELS" kvwire; \
    else \
      /opt/kvwire/bin/pip install --no-deps /src; \
    fi

FROM ${BASE}
RUN set -eu; command -v python3 >/dev/null || { \
      apt-get update; DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3; \
      rm -rf /var/lib/apt/lists/*; }; \
    useradd --system kvwire
COPY --from=builder /opt/kvwire /opt/kvwire
# numba caches compiled kernels beside the module by default; site-packages is read-only here.
ENV PATH=/opt/kvwire/bin:$PATH NUMBA_CACHE_DIR=/tmp/numba-cache PYTHONUNBUFFERED=1
USER kvwire
EXPOSE 8080
ENTRYPOINT ["kvwire"]
CMD ["index", "--http", "0.0.0.0:8080"]
