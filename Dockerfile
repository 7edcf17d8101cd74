# One image for every process of the example: web, worker, beat and the release step.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app

# dependencies first, from pyproject alone (an empty package stands in for the source), so
# a code change does not reinstall them
COPY pyproject.toml README.md* ./
RUN mkdir sagaworker && touch sagaworker/__init__.py && pip install ".[web]" \
    && pip uninstall -y sagaworker && rm -r sagaworker

# then the library (the only package of the wheel) and the example beside it
COPY sagaworker ./sagaworker
RUN pip install --no-deps .
COPY tasks ./tasks
COPY config ./config
COPY Procfile ./

RUN useradd --create-home --uid 10001 app && mkdir -p /app/var && chown app /app/var
USER app
WORKDIR /app/var

EXPOSE 8000
ENV PORT=8000
CMD ["gunicorn", "--worker-class", "gthread", "--workers", "1", "--threads", "8", \
     "--graceful-timeout", "60", "--access-logfile", "-", "tasks.web:create_app()"]
