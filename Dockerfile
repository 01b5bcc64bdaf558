# One image for every moemesh edge node and for the controller.
#
# Online:   docker build -t moemesh/moemesh .
# Offline (no registry, no network in builds; see docker/README.md):
#   docker/build-base.sh && docker/fetch-wheels.sh
#   docker build --build-arg BASE_IMAGE=moemesh/base:bookworm -t moemesh/moemesh .
#
# Layers, cheapest to rebuild last: the dependencies (a virtual environment built in a separate
# stage from pyproject.toml and, when present, the wheels in docker/wheels) come before the
# sources, so editing code rebuilds only the last small layers, and the wheels never reach the
# final image. No `# syntax=` line and no RUN --mount: the legacy builder, BuildKit and
# docker-compose v1 all build it, with nothing to pull but BASE_IMAGE.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps
# Online builds may point pip elsewhere (a mirror, a CPU-only torch index); empty = pip's default.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG EXTRA_REQUIREMENTS=""
COPY pyproject.toml requirements.lock docker/requirements.py docker/install-deps.sh /build/
COPY docker/wheels/ /build/wheels/
RUN EXTRA_REQUIREMENTS="${EXTRA_REQUIREMENTS}" sh /build/install-deps.sh /opt/moemesh /build

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="moemesh" \
      org.opencontainers.image.description="Emulator for distributed edge MoE inference: one edge node or the controller"
ENV VIRTUAL_ENV=/opt/moemesh \
    PATH=/opt/moemesh/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    MOEMESH_HOST=0.0.0.0 \
    MOEMESH_PORT=8000 \
    MOEMESH_STATE_DIR=/var/lib/moemesh
# The image's own user. A node that shapes its links with tc needs NET_ADMIN, which only root's
# capability set carries: compose runs nodes as root with cap_add: [NET_ADMIN] (see compose.yaml).
RUN groupadd --system --gid 10001 moemesh \
    && useradd --system --uid 10001 --gid moemesh --home-dir /app --no-create-home \
       --shell /usr/sbin/nologin moemesh
COPY --from=deps /opt/moemesh /opt/moemesh
COPY docker/healthcheck.py /opt/moemesh/healthcheck.py
WORKDIR /app
COPY pyproject.toml README.md requirements.lock /app/
COPY moe /app/moe
COPY netem /app/netem
COPY services /app/services
COPY router /app/router
COPY orchestrator /app/orchestrator
COPY experiments /app/experiments
COPY bench /app/bench
# The sources are importable from the venv (like an editable install) and `moemesh` is on PATH;
# bytecode is compiled now, since the non-root user cannot write it next to the sources;
# matplotlib's font cache too (a report's first plot otherwise spends 20-60 s building it).
RUN site=$(/opt/moemesh/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && echo /app >"$site/moemesh-src.pth" \
    && printf '#!/opt/moemesh/bin/python\nimport sys\nfrom orchestrator.cli import main\nsys.exit(main())\n' \
       >/opt/moemesh/bin/moemesh \
    && chmod 755 /opt/moemesh/bin/moemesh \
    && /opt/moemesh/bin/python -m compileall -q /app \
    && mkdir -p /results /var/lib/moemesh && chown moemesh:moemesh /results /var/lib/moemesh \
    && /opt/moemesh/bin/python -c 'import matplotlib.font_manager' \
    && chmod -R a+rwX "$MPLCONFIGDIR" \
    && moemesh --help >/dev/null
USER moemesh
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=4s --start-period=180s --retries=3 \
    CMD ["/opt/moemesh/bin/python", "/opt/moemesh/healthcheck.py"]
CMD ["moemesh", "node"]
