# Tether operator image (also usable as the example worker image: it carries examples/).
# Multi-stage: build a wheel and a virtualenv, copy only the virtualenv into a slim runtime.
# BASE: any Debian-like image with Python 3.11 (`python -m venv`, groupadd/useradd). The project's
# CI, which reaches no registry, builds on a local debootstrap of bookworm (hack/build-images.sh).
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
WORKDIR /src
# Reproducible bytes (make release): with SOURCE_DATE_EPOCH set, pip compiles hash-checked .pyc files
# instead of ones stamped with the install's time.
ENV SOURCE_DATE_EPOCH=315532800
RUN python -m venv /opt/tether && /opt/tether/bin/pip install --no-cache-dir --upgrade pip
# The dependencies first, named by pyproject.toml alone: a build after a source change reuses this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['otel']))" > /tmp/requirements.txt \
 && /opt/tether/bin/pip install --no-cache-dir -r /tmp/requirements.txt
COPY README.md ./
COPY operator ./operator
RUN /opt/tether/bin/pip install --no-cache-dir --no-deps .

FROM ${BASE}
# (useradd stamps /etc/shadow with the day it ran unless SOURCE_DATE_EPOCH says otherwise.)
RUN export SOURCE_DATE_EPOCH=315532800 && groupadd --gid 65532 tether && useradd --uid 65532 --gid 65532 --no-create-home --shell /sbin/nologin tether
COPY --from=build /opt/tether /opt/tether
COPY examples /app/examples
COPY tests/support/worker_app.py /app/tests/support/worker_app.py
WORKDIR /app
ENV PATH=/opt/tether/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["tether"]
CMD ["operator"]
