"""The servers a run talks to, checked before it starts, and MLflow's HTTP retries bounded while it runs.

An unreachable MLflow tracking server or Prefect API is one clear error within ``CHECK_SECONDS``, before anything
is recorded, instead of minutes of retries. Once a run is going, MLflow's retries are bounded (``tasks.tracking``).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import mlflow

from tasks.tracking import mlflow_ui_base

CHECK_SECONDS = 10.0


class ServerUnreachable(RuntimeError):
    pass


def _get(url: str, timeout: float) -> None:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http(s) only, checked by the callers)
        response.read(1024)


def check_servers(timeout: float | None = None) -> None:
    """Raise ServerUnreachable naming the server and the setting that points at it, if either does not answer."""
    timeout = timeout or CHECK_SECONDS
    checks = []
    uri = mlflow.get_tracking_uri()
    if uri.startswith(("http://", "https://")):
        checks.append(("the MLflow tracking server", "MLFLOW_TRACKING_URI", mlflow_ui_base() + "/health",
                       "start it (zhflow server) or unset MLFLOW_TRACKING_URI to track into ./mlflow.db"))
    from prefect.settings import get_current_settings

    # the environment as it is now, else what Prefect read when it loaded (a profile, .env or prefect.toml)
    api = os.environ.get("PREFECT_API_URL") or str(get_current_settings().api.url or "")
    if api.startswith(("http://", "https://")):
        checks.append(("the Prefect server", "PREFECT_API_URL", api.rstrip("/") + "/health",
                       "start it (zhflow server) or unset PREFECT_API_URL to run on a temporary local server"))
    for name, setting, url, remedy in checks:
        try:
            _get(url, timeout)
        except urllib.error.HTTPError:
            continue  # it answered (an authenticating proxy in front, say): reachable
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            shown = url.split("@")[-1] if "@" in url else url
            raise ServerUnreachable(f"{name} at {shown} ({setting}) did not answer within {timeout:.0f} s: {reason}; "
                                    f"{remedy}") from None


def describe_failure(err: BaseException) -> str:
    """One line for a failed flow: ``Type: first line``, saying which server stopped answering when that is the cause."""
    text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    import httpx  # Prefect's client

    if isinstance(err, httpx.TransportError):
        from prefect.settings import get_current_settings

        api = os.environ.get("PREFECT_API_URL") or get_current_settings().api.url or "the temporary local server"
        return f"the Prefect server at {api} stopped answering ({text})"
    if type(err).__name__ == "MlflowException" and "API request to" in str(err):
        return f"the MLflow tracking server at {mlflow_ui_base()} stopped answering ({text[:300]})"
    return text
