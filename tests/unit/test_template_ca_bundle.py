"""A sandbox with secrets gets its template's CA bundle with its own CA (network.backend):
the bundle is read as the sandbox would see it. A template built from an untrusted
Dockerfile or image may make it a link to a host file (/etc/shadow): that is never read."""

from __future__ import annotations

from pathlib import Path

from cpuosd.network.backend import template_ca_bundle


def test_the_ca_bundle_is_read_inside_the_tree(tmp_path: Path) -> None:
    certs = tmp_path / "etc/ssl/certs"
    certs.mkdir(parents=True)
    bundle = certs / "ca-certificates.crt"
    secret = tmp_path.parent / f"{tmp_path.name}-host-secret"
    secret.write_text("host secret")
    for target in (str(secret), "../../../../../../../" + str(secret).lstrip("/")):
        bundle.symlink_to(target)  # absolute, or climbing out: both mean paths in the tree
        assert template_ca_bundle(tmp_path) == ""
        bundle.unlink()
    (tmp_path / "elsewhere.pem").write_text("PEM\n")
    bundle.symlink_to("/elsewhere.pem")  # a link inside the tree is followed inside it
    assert template_ca_bundle(tmp_path) == "PEM\n"
    bundle.unlink()
    bundle.mkdir()  # not a regular file
    assert template_ca_bundle(tmp_path) == ""
    assert template_ca_bundle(tmp_path / "missing") == ""
