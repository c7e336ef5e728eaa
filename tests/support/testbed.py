"""Real servers for the cluster tests and benchmarks, each a child process on 127.0.0.1 in
a directory of its own, started and stopped by pid: Postgres (Debian's ``postgresql``,
run as its ``postgres`` user when we are root), an S3 server (moto's, from PyPI), and
etcd + kube-apiserver (built by scripts/build-k8s.sh) with their own CA, certificates and
tokens. Nothing here listens beyond loopback or sends a packet off the machine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from cpuosd.store import SqliteStore, Store

from .daemon import free_port as free_port  # (the one chooser of test ports)
from .daemon import SLOW_TEARDOWN, http_get

T = TypeVar("T")

K8S_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.0"
K8S_PREFIX = Path(os.environ.get("CPUOS_K8S_PREFIX", "/usr/local/lib/cpuos"))


def wait_for(cond: Callable[[], bool], what: str, timeout: float,
             proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    """Poll ``cond`` until it holds; an error naming ``what`` (and the end of ``log``) if
    ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({proc.returncode})" + _tail(log))
        with contextlib.suppress(Exception):
            if cond():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f} s" + _tail(log))
        time.sleep(0.1)


def _tail(log: Path | None) -> str:
    if log is None:
        return ""
    try:
        return ":\n" + log.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM,
                 timeout: float = 30) -> None:
    """Stop one child we started (by its pid): ``sig``, then SIGKILL after ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _log(path: Path) -> IO[bytes]:
    return open(path, "ab", opener=lambda p, f: os.open(p, f, 0o600))


# ---- Postgres ---------------------------------------------------------------------------

def postgres_bindir() -> Path | None:
    """Debian's newest ``/usr/lib/postgresql/<major>/bin`` (initdb and postgres)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(Path(p).parent.parent.name)
                   if Path(p).parent.parent.name.isdigit() else 0)
    return Path(found[-1]).parent if found else None


def postgres_unavailable() -> str | None:
    if postgres_bindir() is None:
        return ("Postgres is not installed (Debian's postgresql package: "
                "scripts/setup.sh --dev installs it)")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "no postgres user to run Postgres as (Debian's postgresql package makes it)"
    return None


class PostgresServer:
    """One Postgres cluster: ``initdb`` into a temporary directory, ``postgres`` on a free
    port of 127.0.0.1 (and a unix socket there), password authentication, no fsync (a
    test bed, not a store to keep). Run as the ``postgres`` user when we are root (Postgres
    refuses root)."""

    def __init__(self, base: Path | None = None) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError(postgres_unavailable() or "no Postgres")
        self.bindir = bindir
        self._own_base = base is None
        self.base = base or Path(tempfile.mkdtemp(prefix="cpuos-pg-"))
        self.data, self.sock = self.base / "data", self.base / "sock"
        self.log = self.base / "postgres.log"
        self.user = "cpuos"
        self.password = secrets.token_hex(16)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
            self._uid_gid = (pw.pw_uid, pw.pw_gid)

    def start(self, timeout: float = 120) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o700)
        self.sock.mkdir(exist_ok=True)
        pwfile = self.base / "pw"
        pwfile.write_text(self.password + "\n")
        if self._as:
            for p in (self.base, self.sock, pwfile):
                os.chown(p, *self._uid_gid)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        r = subprocess.run([str(self.bindir / "initdb"), "-D", str(self.data), "-U", self.user,
                            f"--pwfile={pwfile}", "--auth=scram-sha-256", "-E", "UTF8",
                            "--no-sync", "--no-instructions"],
                           capture_output=True, env=env, timeout=timeout, cwd=self.base,
                           **self._as)
        pwfile.unlink()
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {(r.stdout + r.stderr).decode()[-2000:]}")
        for _ in range(5):  # (a free port can be taken by another before postgres binds it)
            self.port = free_port()
            with _log(self.log) as logf:
                if self._as:
                    os.chown(self.log, *self._uid_gid)
                self.proc = subprocess.Popen(
                    [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port),
                     "-k", str(self.sock), "-c", "listen_addresses=127.0.0.1",
                     "-c", "fsync=off", "-c", "synchronous_commit=off",
                     "-c", "full_page_writes=off", "-c", "max_connections=200",
                     "-c", "shared_buffers=64MB"],
                    stdout=logf, stderr=logf, env=env, cwd=self.base,
                    start_new_session=True, **self._as)
            try:
                wait_for(self._ready, "postgres", timeout, self.proc, self.log)
                return
            except RuntimeError:
                if "already in use" not in _tail(self.log):
                    raise
        raise RuntimeError("postgres: no free port found")

    def _ready(self) -> bool:
        import psycopg

        with psycopg.connect(self.url(), connect_timeout=2):
            return True

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{db}"

    def create_database(self, name: str | None = None) -> str:
        """A new, empty database; its URL."""
        import psycopg

        name = name or "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as c:
            c.execute(f'CREATE DATABASE "{name}"'.encode())
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())

    def stop(self) -> None:
        # SIGINT: Postgres's fast shutdown (ends its sessions, stops its own children)
        stop_process(self.proc, signal.SIGINT)
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)


# ---- S3 ---------------------------------------------------------------------------------

def s3_unavailable() -> str | None:
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        return f"the S3 test server needs moto[server] and boto3 (the cluster extra): {e}"
    return None


class S3Server:
    """moto's S3 server (``python -m moto.server``) on a free port of 127.0.0.1, in a
    process of its own; any credentials are accepted, buckets live in its memory."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.log = base / "s3.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.access_key, self.secret_key = "cpuos-test", secrets.token_hex(16)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({"AWS_ACCESS_KEY_ID": self.access_key,
                    "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1",
                    "MOTO_CALL_RESET_API": "false"})
        for _ in range(5):
            self.port = free_port()
            with _log(self.log) as logf:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                     str(self.port)], stdout=logf, stderr=logf, env=env,
                    start_new_session=True)
            try:
                wait_for(lambda: http_get(self.endpoint + "/moto-api/", timeout=2)
                         .status_code < 500, "moto S3 server", timeout, self.proc, self.log)
                return
            except RuntimeError:
                if "in use" not in _tail(self.log):
                    raise
        raise RuntimeError("moto: no free port found")

    def env(self, bucket: str, prefix: str = "snapshots") -> dict[str, str]:
        """What a daemon sets to use this server as its snapshot store."""
        return {"CPUOS_SNAPSHOT_STORE": f"s3://{bucket}/{prefix}",
                "CPUOS_S3_ENDPOINT": self.endpoint, "CPUOS_S3_REGION": "us-east-1",
                "CPUOS_S3_ACCESS_KEY_ID": self.access_key,
                "CPUOS_S3_SECRET_ACCESS_KEY": self.secret_key}

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id=self.access_key,
                     aws_secret_access_key=self.secret_key).create_bucket(Bucket=name)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 15)


# ---- etcd + kube-apiserver --------------------------------------------------------------

def kube_binaries() -> tuple[Path, Path]:
    return (K8S_PREFIX / f"etcd-{ETCD_VERSION}" / "etcd",
            K8S_PREFIX / f"kubernetes-{K8S_VERSION}" / "kube-apiserver")


def kube_unavailable() -> str | None:
    etcd, apiserver = kube_binaries()
    for b in (etcd, apiserver):
        if not os.access(b, os.X_OK):
            return f"{b} is not built (scripts/build-k8s.sh, about 7.5 min once)"
    try:
        import kubernetes_asyncio  # noqa: F401
    except ImportError:
        return "kubernetes_asyncio is not installed (the cluster extra)"
    return None


@dataclass(frozen=True)
class KubeUser:
    name: str
    token: str
    groups: tuple[str, ...]


def _pki(d: Path) -> None:
    """A CA, the apiserver's serving certificate (127.0.0.1, localhost) and the service
    account signing key pair, in ``d``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.UTC)

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM,
                               serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    def write(name: str, data: bytes) -> None:
        p = d / name
        p.write_bytes(data)
        p.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cpuos-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    sa = ec.generate_private_key(ec.SECP256R1())
    write("ca.crt", ca.public_bytes(serialization.Encoding.PEM))
    write("apiserver.crt", cert.public_bytes(serialization.Encoding.PEM))
    write("apiserver.key", pem_key(key))
    write("sa.key", pem_key(sa))
    write("sa.pub", sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo))


class KubeApiserver:
    """etcd and kube-apiserver on free ports of 127.0.0.1 (no kubelet, no controllers: the
    API and its storage only), RBAC on, static bearer tokens: ``admin``
    (system:masters) and whatever ``users`` the caller names (e.g. a ServiceAccount's
    name and groups, to prove RBAC rules)."""

    def __init__(self, base: Path, users: tuple[KubeUser, ...] = ()) -> None:
        self.base = base
        self.etcd_bin, self.apiserver_bin = kube_binaries()
        self.admin = KubeUser("cpuos-admin", secrets.token_hex(16), ("system:masters",))
        self.users = (self.admin, *users)
        self.etcd: subprocess.Popen[bytes] | None = None
        self.apiserver: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.base / "pki" / "ca.crt"

    def start(self, timeout: float = 180) -> None:
        import httpx

        pki = self.base / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o700)
        _pki(pki)
        tokens = self.base / "tokens.csv"
        tokens.write_text("".join(f'{u.token},{u.name},{u.name},"{",".join(u.groups)}"\n'
                                  for u in self.users))
        tokens.chmod(0o600)
        client_port, peer_port = free_port(), free_port()
        etcd_log = self.base / "etcd.log"
        with _log(etcd_log) as logf:
            self.etcd = subprocess.Popen(
                [str(self.etcd_bin), "--name", "default", "--data-dir", str(self.base / "etcd"),
                 "--listen-client-urls", f"http://127.0.0.1:{client_port}",
                 "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                 "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
                 "--listen-metrics-urls", "", "--unsafe-no-fsync",
                 "--quota-backend-bytes", str(256 << 20), "--log-level", "warn"],
                stdout=logf, stderr=logf, start_new_session=True)
        wait_for(lambda: http_get(f"http://127.0.0.1:{client_port}/health", timeout=2)
                 .status_code == 200, "etcd", 60, self.etcd, etcd_log)
        self.port = free_port()
        log = self.base / "kube-apiserver.log"
        with _log(log) as logf:
            self.apiserver = subprocess.Popen(
                [str(self.apiserver_bin),
                 f"--etcd-servers=http://127.0.0.1:{client_port}",
                 "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                 f"--secure-port={self.port}", f"--cert-dir={self.base / 'certs'}",
                 f"--tls-cert-file={pki / 'apiserver.crt'}",
                 f"--tls-private-key-file={pki / 'apiserver.key'}",
                 f"--token-auth-file={tokens}", "--authorization-mode=RBAC",
                 "--anonymous-auth=false",
                 "--service-account-issuer=https://kubernetes.default.svc",
                 f"--service-account-key-file={pki / 'sa.pub'}",
                 f"--service-account-signing-key-file={pki / 'sa.key'}",
                 "--service-cluster-ip-range=10.96.0.0/24",
                 "--endpoint-reconciler-type=none", "--allow-privileged=true",
                 "--enable-priority-and-fairness=false", "--profiling=false",
                 "--v=1"],
                stdout=logf, stderr=logf, start_new_session=True)
        wait_for(lambda: httpx.get(self.url + "/readyz", verify=str(self.ca), timeout=5,
                                   headers={"Authorization": f"Bearer {self.admin.token}"})
                 .status_code == 200, "kube-apiserver", timeout, self.apiserver, log)

    def kubeconfig(self, user: KubeUser | None = None, namespace: str = "default") -> Path:
        """A kubeconfig for ``user`` (default: the admin)."""
        import yaml

        u = user or self.admin
        p = self.base / f"kubeconfig-{u.name.replace(':', '_')}"
        p.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                      "certificate-authority": str(self.ca)}}],
            "users": [{"name": u.name, "user": {"token": u.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": u.name,
                                                      "namespace": namespace}}]}))
        p.chmod(0o600)
        return p

    def stop(self) -> None:
        stop_process(self.apiserver, signal.SIGTERM, 30)
        stop_process(self.etcd, signal.SIGTERM, 30)


def open_test_store(where: str) -> Store:
    """The state store at ``where``: a Postgres URL, or a SQLite file's path."""
    if where.startswith("postgresql://"):
        from cpuosd.store.postgres import PostgresStore

        return PostgresStore(where, max_size=4)
    return SqliteStore(Path(where))


@contextlib.contextmanager
def postgres(base: Path | None = None) -> Iterator[PostgresServer]:
    pg = PostgresServer(base)
    try:
        pg.start()
        yield pg
    finally:
        pg.stop()


# ---- many hosts on one host: node and API processes ------------------------------------

class ApiProcess:
    """One ``cpuosd --role=api`` (no root needed; a scratch home for its log)."""

    def __init__(self, database_url: str, token: str, lease: str = "3",
                 extra: dict[str, str] | None = None) -> None:
        # (its API port and its preview port: cpuosd.cluster.preview)
        self.port, self.preview_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.preview_url = f"http://127.0.0.1:{self.preview_port}"
        self.home = Path(tempfile.mkdtemp(prefix="cpuos-api-", dir="/tmp"))
        self.log = self.home / "cpuosd.log"
        env = {**os.environ, "CPUOS_ROLE": "api", "CPUOS_HOME": str(self.home),
               "CPUOS_HOST": "127.0.0.1", "CPUOS_PORT": str(self.port),
               "CPUOS_DATABASE_URL": database_url, "CPUOS_NODE_TOKEN": token,
               "CPUOS_NODE_LEASE": lease, "CPUOS_PREVIEW_PORT": str(self.preview_port),
               **(extra or {})}
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "cpuosd.main"], env=env,
                                         stdout=logf, stderr=logf, start_new_session=True)

    def health(self) -> dict[str, Any]:
        import httpx

        try:
            r = http_get(self.url + "/health", timeout=2)
            return dict(r.json()) if r.status_code == 200 else {}
        except httpx.TransportError:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cpuosd --role=api exited: {_tail(self.log)}") from None
            return {}

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 15)
        shutil.rmtree(self.home, ignore_errors=True)


def start_api(database_url: str, token: str, lease: str = "3",
              extra: dict[str, str] | None = None, tries: int = 5) -> ApiProcess:
    """An API process on free ports, answering /health. Started again on other ports when
    it found one of its ports taken: another worker's listener can bind a port between our
    choice (free_port) and the API process's bind (seen once in a local run of the suite)."""
    from .daemon import wait_until

    for _ in range(tries):
        a = ApiProcess(database_url, token, lease, extra)
        try:
            wait_until(lambda a=a: bool(a.health()),  # type: ignore[misc]
                       "the API process to answer /health", 60)
            return a
        except Exception as e:
            a.stop()
            if not isinstance(e, RuntimeError) or "address already in use" not in str(e):
                raise
    raise RuntimeError(f"no API process started in {tries} tries: its ports were taken")


def _all_started(starts: list[Callable[[], T]], stop: Callable[[T], None] | None = None
                 ) -> list[T]:
    """Run ``starts`` (each starts a process and waits until it answers) at once, one
    thread each: a cluster's processes come up side by side (each start is mostly waiting:
    its imports, its database, its template). If one fails, the others are still waited
    for, those that started are stopped (``stop``) and the first failure is raised."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(starts))) as pool:
        futures = [pool.submit(f) for f in starts]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        if stop is not None:
            for f in futures:
                if f.exception() is None:
                    stop(f.result())
        raise errors[0]  # type: ignore[misc]
    return [f.result() for f in futures]


@dataclass
class Cluster:
    nodes: list[Any]  # support.daemon.Daemon, each started with --role=node
    apis: list[ApiProcess]
    key: str  # the admin workspace's key
    token: str  # the node token


@contextlib.contextmanager
def node_cluster(database_url: str, node_env: dict[str, str] | None = None,
                 api_env: dict[str, str] | None = None, n_nodes: int = 2, n_apis: int = 2,
                 lease: str = "3") -> Iterator[Cluster]:
    """``n_nodes`` real node processes (``node-a``, ``node-b``...: own homes, network slots,
    ports; runsc) and ``n_apis`` API processes over one database, sharing a node token, an
    audit key, an E2B key and a secrets key; every sandbox deleted and every process
    stopped at the end (a leftover runsc container or mount raises). The nodes' preview
    URLs name the first API process's preview listener (CPUOS_PREVIEW_PUBLIC_ADDRESS)."""
    import httpx

    from .daemon import new_daemon, wait_until

    token = secrets.token_hex(16)
    key_dir = Path(tempfile.mkdtemp(prefix="cpuos-auditkey-", dir="/tmp"))
    # (the same on every node, as a Secret's file; secrets.key: CPUOS_SECRETS_KEY_FILE)
    for name in ("audit.key", "e2b.key", "secrets.key"):
        (key_dir / name).write_text(secrets.token_hex(32) + "\n")
        (key_dir / name).chmod(0o600)
    # the API processes first, each answering on its ports (start_api), so that the nodes'
    # preview URLs can name the first one's preview listener
    failed = True
    try:
        apis = _all_started([functools.partial(
            start_api, database_url, token, lease,
            {"CPUOS_E2B_KEY_FILE": str(key_dir / "e2b.key"), **(api_env or {})})
            for _ in range(n_apis)], ApiProcess.stop)
    except BaseException:
        shutil.rmtree(key_dir, ignore_errors=True)
        raise
    env = {"CPUOS_ROLE": "node", "CPUOS_DATABASE_URL": database_url,
           "CPUOS_PREVIEW_PUBLIC_ADDRESS": f"127.0.0.1:{apis[0].preview_port}" if n_apis else "",
           "CPUOS_NODE_TOKEN": token, "CPUOS_NODE_LEASE": lease, "CPUOS_POOL_SIZE": "0",
           "CPUOS_HOST": "127.0.0.1", "CPUOS_AUDIT_KEY_FILE": str(key_dir / "audit.key"),
           "CPUOS_E2B_KEY_FILE": str(key_dir / "e2b.key"),
           "CPUOS_SECRETS_KEY_FILE": str(key_dir / "secrets.key"),
           **(node_env or {})}
    nodes = [new_daemon(CPUOS_NODE_ID=f"node-{chr(ord('a') + i)}", **env)
             for i in range(n_nodes)]
    try:
        _all_started([d.start for d in nodes])  # (a failed one is torn down below)
        for a in apis:
            wait_until(lambda a=a: a.health().get("nodes_alive") == n_nodes,  # type: ignore[misc]
                       "the API process to see every node", timeout=120)
        yield Cluster(nodes, apis, nodes[0].key, token)
        failed = False
    finally:
        t0 = time.monotonic()
        for a in apis:
            a.stop()
        t1 = time.monotonic()
        for d in nodes:
            if d.proc is not None and d.proc.poll() is None:
                with httpx.Client(base_url=d.url, timeout=30, headers={
                        "Authorization": f"Bearer {d.key}",
                        "X-Cpuos-Node-Token": token}) as c:
                    try:
                        for s in c.get("/sandboxes").json()["sandboxes"]:
                            c.delete(f"/sandboxes/{s['id']}")
                    except httpx.HTTPError:
                        pass
        t2 = time.monotonic()
        if t2 - t0 >= SLOW_TEARDOWN:  # (each node's own teardown says its own)
            warnings.warn(f"slow teardown of a test cluster: API processes stopped in "
                          f"{t1 - t0:.1f} s, the nodes' sandboxes deleted in {t2 - t1:.1f} s",
                          stacklevel=2)
        left = [x for d in nodes for x in d.teardown(failed)]
        shutil.rmtree(key_dir, ignore_errors=True)
        if left:
            raise RuntimeError(f"left behind by the cluster: {left}")


def node_of(database_url: str, sid: str) -> str | None:
    """The node a sandbox's row names (None: on no node, or no such row)."""
    s = open_test_store(database_url)
    try:
        row = s.get_sandbox(sid)
        return row.node_id if row else None
    finally:
        s.close()


def place_only_on(database_url: str, key: str, apis: list[ApiProcess],
                  here: str | None) -> None:
    """Every node of a two-node cluster cordoned but ``here`` (None: none cordoned), until
    every API process sees it so, with the nodes left to place on alive."""

    from .daemon import wait_until

    want = {n: here is not None and n != here for n in ("node-a", "node-b")}
    store = open_test_store(database_url)
    try:
        for n, cordoned in want.items():
            store.set_node_cordoned(n, cordoned)
    finally:
        store.close()

    def seen(api: ApiProcess) -> bool:
        r = http_get(api.url + "/nodes", headers={"Authorization": f"Bearer {key}"})
        nodes = r.json()["nodes"]
        return {n["id"]: n["cordoned"] for n in nodes} == want and all(
            n["alive"] for n in nodes if not n["cordoned"])

    for api in apis:
        wait_until(lambda api=api: seen(api),  # type: ignore[misc]
                   f"placement on {here or 'both'}", timeout=30)
