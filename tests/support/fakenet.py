"""A fake internet for tests and benchmarks: a network namespace with no route off this
machine, which a test daemon's uplink leads into (``CPUOS_UPLINK_NETNS``), holding
- a DNS server (198.51.100.53, dnslib) with the test names below (A, and AAAA for the IPv6
  addresses among them, which nothing here listens on);
- a web server at 198.51.100.10 (HTTP on 80 and 8080, HTTPS on 8443 with a certificate from
  the fake internet's own CA, ``ca_path``; a TCP sink on 443 that records the TLS
  ClientHello's first bytes; on 2222 a server that speaks first, an SSH-like banner),
  answering ``/redirect`` with a 307 to the metadata address, ``/bytes/<n>`` with n bytes,
  ``/gzip-echo``, ``/deflate-echo``, ``/br-echo`` (``-chunked``) with the request's headers
  compressed whatever the request asked for (br: claimed, not done), ``/upgrade`` with a 101
  and then every byte back upper-cased, anything else (GET or POST) with the request's
  headers as JSON;
- listeners where sandboxes must never get: 10.9.9.9, 169.254.169.254, 100.64.1.1,
  [fd00:ec2::254] (TCP 80, UDP 53), and SMTP on 198.51.100.25 (25, 465, 587, 2525).
Every listener appends what it saw to ``log_path`` (JSON lines: listener, peer, first bytes),
so a test checks the servers' side, not only the client's error.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WEB = "198.51.100.10"
DNS = "198.51.100.53"
SMTP = "198.51.100.25"
DENIED_LISTENERS = ("10.9.9.9", "169.254.169.254", "100.64.1.1", "fd00:ec2::254")
NAMES = {  # name -> addresses (rebind.test alternates; an IPv6 one answers AAAA queries)
    "allowed.test": [WEB, "2606:4700::10"], "other.test": [WEB], "redirect.test": [WEB],
    "evil.test": ["10.9.9.9"], "meta.test": ["169.254.169.254"],
    "169.254.169.254.nip.test": ["169.254.169.254"], "rebind.test": [WEB, "10.9.9.9"],
    "mail.test": [SMTP],
}

SERVER = r'''
import gzip, json, socket, sys, threading, http.server, socketserver, zlib
from dnslib import DNSRecord, RR, QTYPE, A, AAAA, RCODE
names = json.loads(sys.argv[2]); log_path = sys.argv[1]; lock = threading.Lock()
counter = {}
def log(listener, peer, data=b""):
    with lock, open(log_path, "a") as f:
        f.write(json.dumps({"listener": listener, "peer": str(peer),
                            "data": data[:300].decode("latin-1")}) + "\n")
def tcp_sink(host, port):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(64)
    def loop():
        while True:
            c, peer = s.accept(); c.settimeout(2)
            try: data = c.recv(4096)
            except OSError: data = b""
            log(f"{host}:{port}", peer, data); c.close()
    threading.Thread(target=loop, daemon=True).start()
def udp_sink(host, port):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM); s.bind((host, port))
    def loop():
        while True:
            data, peer = s.recvfrom(4096); log(f"udp {host}:{port}", peer, data)
    threading.Thread(target=loop, daemon=True).start()
def banner(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(64)
    def loop():
        while True:
            c, peer = s.accept(); c.settimeout(2)
            try:
                c.sendall(b"SSH-2.0-fake\r\n"); data = c.recv(4096)
            except OSError: data = b""
            log(f"{host}:{port}", peer, data); c.close()
    threading.Thread(target=loop, daemon=True).start()
class Web(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        self.do_GET(body)
    def do_GET(self, body=b""):
        log(f"{self.server.server_address[0]}:{self.server.server_address[1]}", self.client_address,
            self.requestline.encode() + b"\n" + bytes(self.headers) + body)
        kind = self.path.split("?")[0].strip("/").split("-echo")[0]
        if self.path.split("?")[0].strip("/").split("-chunked")[0] in (
                "gzip-echo", "deflate-echo", "br-echo"):
            plain = json.dumps({"hello": True, "headers": dict(self.headers)}).encode()
            data = {"gzip": gzip.compress, "deflate": zlib.compress}.get(kind, bytes)(plain)
            self.send_response(200); self.send_header("Content-Encoding", kind)
            self.send_header("Content-Type", "application/json")
            if "-chunked" in self.path:
                self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
                for i in range(0, len(data), 7):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data[i:i + 7]), data[i:i + 7]))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(len(data))); self.end_headers()
                self.wfile.write(data)
            return
        if self.path == "/upgrade":
            self.send_response(101); self.send_header("Upgrade", "echo")
            self.send_header("Connection", "Upgrade"); self.end_headers(); self.wfile.flush()
            while True:
                data = self.rfile.read1(4096)
                if not data:
                    break
                self.wfile.write(data.upper()); self.wfile.flush()
            self.close_connection = True
            return
        if self.path == "/redirect":
            self.send_response(307); self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.send_header("Content-Length", "0"); self.end_headers(); return
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2]); self.send_response(200)
            self.send_header("Content-Length", str(n)); self.end_headers()
            chunk = b"x" * 65536
            while n > 0:
                self.wfile.write(chunk[:min(n, 65536)]); n -= 65536
            return
        body = json.dumps({"hello": True, "headers": dict(self.headers)}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
class TS(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True; allow_reuse_address = True
for port in (80, 8080):
    srv = TS((sys.argv[3], port), Web)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
import ssl
tls = TS((sys.argv[3], 8443), Web)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[7], sys.argv[8])
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=tls.serve_forever, daemon=True).start()
tcp_sink(sys.argv[3], 443)
banner(sys.argv[3], 2222)
for h in json.loads(sys.argv[4]):
    tcp_sink(h, 80); udp_sink(h, 53)
for p in (25, 465, 587, 2525):
    tcp_sink(sys.argv[5], p)
d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); d.bind((sys.argv[6], 53))
print("ready", flush=True)
while True:
    data, peer = d.recvfrom(4096)
    try:
        q = DNSRecord.parse(data)
    except Exception:
        continue
    name = str(q.q.qname).rstrip(".").lower(); r = q.reply()
    addrs = names.get(name)
    log("dns", peer, name.encode())
    if addrs is None:
        r.header.rcode = RCODE.NXDOMAIN
    elif q.q.qtype == QTYPE.A:
        v4 = [a for a in addrs if ":" not in a]
        i = counter.get(name, 0); counter[name] = i + 1
        r.add_answer(RR(name, QTYPE.A, rdata=A(v4[i % len(v4)]), ttl=0))
    elif q.q.qtype == QTYPE.AAAA:
        for a in addrs:
            if ":" in a:
                r.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(a), ttl=0))
    d.sendto(r.pack(), peer)
'''


def _sh(*argv: str) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


class FakeInternet:
    def __init__(self, workdir: Path) -> None:
        self.name = f"cpuos-t-inet-{secrets.token_hex(3)}"
        self.workdir = workdir
        self.log_path = workdir / "fakenet.jsonl"
        self.ca_path = workdir / "fakenet-ca.pem"
        self.proc: subprocess.Popen[bytes] | None = None

    def _certs(self) -> tuple[Path, Path]:
        """A CA of the fake internet and a certificate from it for the web server's names
        (HTTPS on WEB:8443), so the egress proxy can verify the server it talks to."""
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake internet CA")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(hours=1))
              .not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        names = [n for n, a in NAMES.items() if WEB in a]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        self.ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        cp, kp = self.workdir / "fakenet-web.pem", self.workdir / "fakenet-web.key"
        cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        kp.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        return cp, kp

    def start(self) -> FakeInternet:
        _sh("ip", "netns", "add", self.name)
        try:
            _sh("ip", "-n", self.name, "link", "set", "lo", "up")
            for a in (WEB, DNS, SMTP, *DENIED_LISTENERS):
                _sh("ip", "-n", self.name, "addr", "add",
                    a + ("/128" if ":" in a else "/32"), "dev", "lo", *(
                        ["nodad"] if ":" in a else []))
            self.log_path.write_text("")
            cert, key = self._certs()
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.name, sys.executable, "-c", SERVER,
                 str(self.log_path), json.dumps(NAMES), WEB, json.dumps(DENIED_LISTENERS),
                 SMTP, DNS, str(cert), str(key)], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True)
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if b"ready" not in line:
                err = self.proc.stderr.read() if self.proc.stderr else b""
                raise RuntimeError(f"fake internet did not start: {err[-800:]!r}")
        except BaseException:
            self.stop()
            raise
        return self

    def env(self) -> dict[str, str]:
        """What a daemon needs to lead its sandboxes here."""
        return {"CPUOS_UPLINK_NETNS": self.name, "CPUOS_DNS_UPSTREAM": DNS,
                "CPUOS_UPSTREAM_CA_FILE": str(self.ca_path)}

    def seen(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            if r.returncode == 0 or b"No such file" in r.stderr:
                return
            time.sleep(0.05)
