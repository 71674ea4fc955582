"""``zhflow server``: a Prefect server and an MLflow tracking server for a team, in one command.

    zhflow server                                   # SQLite for both, 127.0.0.1 only
    ZHFLOW_PREFECT_DATABASE_URL=postgresql://zhflow@127.0.0.1:5432/zhflow_prefect \\
    ZHFLOW_MLFLOW_DATABASE_URL=postgresql://zhflow@127.0.0.1:5432/zhflow_mlflow zhflow server

Both bind to 127.0.0.1 unless ``--host`` says otherwise. Database URLs come from the options or the environment
(never from a file in the repository); a PostgreSQL password belongs in ``PGPASSWORD`` or ``~/.pgpass``, which
both servers' drivers read. Missing PostgreSQL databases are created. MLflow artifacts go to ``--artifacts``
(a folder, or an object store URI such as ``s3://bucket/zhflow``), served through the MLflow server.
Ctrl-C (or SIGTERM) stops both; if one of them dies, the other is stopped too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

PG_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2", "postgresql+asyncpg")


class ServerError(RuntimeError):
    """A server did not start; the message names it and its log."""


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else ""


def prefect_url(url: str) -> str:
    """Prefect's server needs the asyncpg driver for PostgreSQL."""
    return "postgresql+asyncpg://" + url.split("://", 1)[1] if _scheme(url) in PG_SCHEMES else url


def mlflow_url(url: str) -> str:
    """MLflow's store takes SQLAlchemy URLs; psycopg (3) is the driver zhflow installs."""
    return "postgresql+psycopg://" + url.split("://", 1)[1] if _scheme(url) in PG_SCHEMES else url


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))
    return url


def ensure_database(url: str) -> bool:
    """Create the PostgreSQL database named in ``url`` if it does not exist; True if created."""
    import psycopg
    from psycopg import sql

    parts = urlsplit("postgresql://" + url.split("://", 1)[1])
    name = parts.path.lstrip("/")
    if not name:
        raise ServerError(f"{redact(url)}: the URL names no database")
    admin = urlunsplit(parts._replace(path="/postgres"))
    try:
        conn = psycopg.connect(admin, connect_timeout=10, autocommit=True)
    except psycopg.OperationalError as err:
        raise ServerError(f"cannot reach PostgreSQL at {redact(admin)}: {str(err).strip()}") from None
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone():
                return False
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return True
    finally:
        conn.close()


@dataclass
class Servers:
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    prefect_db: str | None = None      # None: Prefect's own default (SQLite in PREFECT_HOME)
    mlflow_db: str = "sqlite:///mlflow.db"
    artifacts: str = "mlartifacts"
    logs: Path = Path(".zhflow/server")
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def prefect_api(self) -> str:
        return f"http://{self._client_host}:{self.prefect_port}/api"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{self._client_host}:{self.mlflow_port}"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    def commands(self) -> dict[str, tuple[list[str], dict]]:
        bin_dir = Path(sys.executable).parent
        prefect_env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": self.prefect_api}
        if self.prefect_db:
            prefect_env["PREFECT_API_DATABASE_CONNECTION_URL"] = prefect_url(self.prefect_db)
        prefect = [str(bin_dir / "prefect"), "server", "start", "--host", self.host, "--port", str(self.prefect_port)]
        artifacts = self.artifacts if "://" in self.artifacts else str(Path(self.artifacts).resolve())
        mlflow = [str(bin_dir / "mlflow"), "server", "--backend-store-uri", mlflow_url(self.mlflow_db),
                  "--artifacts-destination", artifacts, "--host", self.host, "--port", str(self.mlflow_port), "--workers", "1"]
        if self.host not in ("127.0.0.1", "localhost"):
            mlflow += ["--allowed-hosts", "*"]  # reached by other machines' names; put authentication in front (README)
        return {"prefect": (prefect, prefect_env), "mlflow": (mlflow, dict(os.environ))}

    def health_url(self, name: str) -> str:
        return f"{self.prefect_api}/health" if name == "prefect" else f"{self.mlflow_uri}/health"

    def start(self, timeout: float = 180) -> None:
        """Start both and wait until both answer their health check (a ServerError otherwise, both stopped)."""
        for url in (self.prefect_db, self.mlflow_db):
            if url and _scheme(url) in PG_SCHEMES:
                ensure_database(url)
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            for name, (cmd, env) in self.commands().items():
                log = open(self.logs / f"{name}.log", "ab")
                self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)
            deadline = time.monotonic() + timeout
            for name in self.procs:
                self._wait_healthy(name, deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, name: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise ServerError(f"the {name} server exited with code {self.procs[name].returncode}:\n{self.tail(name)}")
            try:
                with urllib.request.urlopen(self.health_url(name), timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise ServerError(f"the {name} server did not answer {self.health_url(name)} in time:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return "\n".join(["  " + line for line in text] + [f"  (whole log: {path})"])

    def stop(self, grace: float = 20) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def wait(self) -> str:
        """Block until one server exits (its name) or a signal arrives (KeyboardInterrupt)."""
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    return name
            time.sleep(1)
