# One image for every process of the example: web, worker, beat and the release step.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app

# dependencies first, so a code change does not reinstall them
COPY pyproject.toml README.md* ./
COPY sagaworker ./sagaworker
COPY tasks ./tasks
COPY config ./config
RUN pip install . "flask>=3.0,<4" "gunicorn>=23,<28"

COPY webapp ./webapp
COPY Procfile ./

RUN useradd --create-home --uid 10001 app && mkdir -p /app/var && chown app /app/var
USER app
WORKDIR /app/var

EXPOSE 8000
ENV PORT=8000
CMD ["gunicorn", "--worker-class", "gthread", "--workers", "1", "--threads", "8", \
     "--graceful-timeout", "60", "--access-logfile", "-", "webapp:create_app()"]
