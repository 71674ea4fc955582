"""Prefect deployments of the zhflow flows (schedules and default parameters)."""
