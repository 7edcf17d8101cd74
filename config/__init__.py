"""Celery and logging configuration for the example app, read from the settings."""
