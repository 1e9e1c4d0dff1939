"""scripts/lib/debian.sh, the offline image build's way to Debian's archive, with the real apt-get and dpkg-deb
against a small archive of real packages served over loopback HTTP (no network is needed).

The archive mimics Debian's: bookworm and bookworm-updates in one archive, bookworm-security in another. The
machine's own installed packages are played by a dpkg status file that ``APT_CONFIG`` hands to apt as the system's,
as a machine's /var/lib/dpkg/status would be: one holding a package at its security update's version (what
installing Debian's prometheus brings from bookworm-security) and one at a version no archive has."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import formatdate
from functools import partial
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "scripts" / "lib" / "debian.sh"

pytestmark = pytest.mark.skipif(
    not (shutil.which("apt-get") and shutil.which("dpkg-deb")), reason="needs Debian's apt-get and dpkg-deb"
)

# What each suite holds: package -> version. bookworm-updates has a package of its own (a stable update).
SUITES = {
    ("debian", "bookworm"): {"fonts-demo": "1.0-1", "libjs-demo": "2.0-1", "tool-demo": "1.0-1"},
    ("debian", "bookworm-updates"): {"tool-demo": "1.0-1+deb12u1"},
    ("debian-security", "bookworm-security"): {"fonts-demo": "1.0-1+deb12u2"},
}


def control(package: str, version: str) -> str:
    return (
        f"Package: {package}\nVersion: {version}\nArchitecture: all\nPriority: optional\nSection: misc\n"
        f"Maintainer: Test <test@example.org>\nDescription: {package}\n"
    )


def status(packages: dict[str, str]) -> str:
    """A dpkg status file holding these packages, installed."""
    return "\n".join(f"{control(p, v)}Status: install ok installed\n" for p, v in packages.items())


def build_deb(pool: Path, package: str, version: str) -> Path:
    root = pool / f"{package}_{version}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "usr" / "share" / package).mkdir(parents=True)
    (root / "usr" / "share" / package / "version").write_text(version + "\n")
    (root / "DEBIAN" / "control").write_text(control(package, version))
    deb = pool / f"{package}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True)
    shutil.rmtree(root)
    return deb


def write_suite(top: Path, suite: str, packages: dict[str, str], origin: str) -> None:
    """dists/SUITE with its Packages index and an unsigned Release file that lists it, as an archive has them."""
    pool = top / "pool" / suite
    pool.mkdir(parents=True)
    entries = []
    for package, version in packages.items():
        deb = build_deb(pool, package, version)
        data = deb.read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        entries.append(
            f"{control(package, version)}Filename: {deb.relative_to(top)}\nSize: {len(data)}\nSHA256: {sha256}\n"
        )
    index = top / "dists" / suite / "main" / "binary-amd64"
    index.mkdir(parents=True)
    packages_text = "\n".join(entries).encode()
    (index / "Packages").write_bytes(packages_text)
    (index / "Packages.gz").write_bytes(gzip.compress(packages_text))
    hashes = "".join(
        f" {hashlib.sha256(f.read_bytes()).hexdigest()} {f.stat().st_size} main/binary-amd64/{f.name}\n"
        for f in (index / "Packages", index / "Packages.gz")
    )
    (top / "dists" / suite / "Release").write_text(
        f"Origin: {origin}\nLabel: {origin}\nSuite: {suite}\nCodename: {suite}\n"
        f"Date: {formatdate(usegmt=True)}\nArchitectures: amd64 all\nComponents: main\nSHA256:\n{hashes}"
    )


@dataclass
class Archive:
    url: str  # the server's root: /debian, /debian-security, /vendor/debian (another vendor's), /missing (404)
    home: Path  # where the tests run: build/ lands here
    env: dict[str, str]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Archive]:
    served = tmp_path_factory.mktemp("archive")
    for (top, suite), packages in SUITES.items():
        write_suite(served / top, suite, packages, "Debian")
    # Another vendor's repository under a /debian path (Docker's has one): its Release says so.
    write_suite(served / "vendor" / "debian", "bookworm-security", {"fonts-demo": "9.9-1"}, "Docker")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    home = tmp_path_factory.mktemp("home")
    # The test archive is not signed: apt is told to accept it (Debian's is, and the scripts check it).
    (home / "apt.conf").write_text(
        'Acquire::AllowInsecureRepositories "true";\nAPT::Get::AllowUnauthenticated "true";\n'
        f'Dir::State::status "{home / "host-status"}";\n'
    )
    env = {
        **os.environ,
        "APT_CONFIG": str(home / "apt.conf"),
        "DEBIAN_MIRROR": f"{url}/debian/",
        "DEBIAN_SECURITY_MIRROR": f"{url}/debian-security",
    }
    try:
        yield Archive(url, home, env)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def host_has(archive: Archive, packages: dict[str, str]) -> None:
    """This machine's dpkg status, as apt reads it, holding these packages."""
    (archive.home / "host-status").write_text(status(packages))


def sh(archive: Archive, script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A bash script that has sourced debian.sh, run where the tests' build/ lives."""
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{LIB}"; {script}', "debian-test", *args],
        cwd=archive.home, env=env or archive.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def downloaded(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.glob("*.deb"))


def test_download_takes_the_newest_of_the_suite_and_its_updates_whatever_the_host_has_installed(
    archive: Archive,
) -> None:
    # The failing state: the host has fonts-demo at its security update's version (as `apt-get install prometheus`
    # brings fonts-glyphicons-halflings from bookworm-security) and libjs-demo at a version no archive has. With
    # the host's status, apt wants those installed versions and finds no source for them.
    host_has(archive, {"fonts-demo": "1.0-1+deb12u2", "libjs-demo": "7.0-1"})
    dest = archive.home / "debs"
    shutil.rmtree(dest, ignore_errors=True)
    done = sh(archive, 'debian_download bookworm "$1" fonts-demo libjs-demo tool-demo', str(dest))
    assert done.returncode == 0, done.stdout + done.stderr
    assert downloaded(dest) == [
        "fonts-demo_1.0-1+deb12u2_all.deb",  # from bookworm-security
        "libjs-demo_2.0-1_all.deb",  # bookworm's, though the host has a newer one
        "tool-demo_1.0-1+deb12u1_all.deb",  # from bookworm-updates
    ]
    # And so with nothing of them installed on the host: the same files.
    host_has(archive, {})
    shutil.rmtree(dest)
    done = sh(archive, 'debian_download bookworm "$1" fonts-demo libjs-demo tool-demo', str(dest))
    assert done.returncode == 0, done.stdout + done.stderr
    assert downloaded(dest) == [
        "fonts-demo_1.0-1+deb12u2_all.deb",
        "libjs-demo_2.0-1_all.deb",
        "tool-demo_1.0-1+deb12u1_all.deb",
    ]


def test_the_apt_state_is_its_own_with_the_three_suites(archive: Archive) -> None:
    host_has(archive, {"fonts-demo": "1.0-1"})
    done = sh(archive, "debian_update bookworm >/dev/null")
    assert done.returncode == 0, done.stdout + done.stderr
    state = archive.home / "build" / "apt-bookworm"
    keyring = "[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]"
    assert (state / "sources.list").read_text().splitlines() == [
        f"deb {keyring} {archive.url}/debian bookworm main",
        f"deb {keyring} {archive.url}/debian bookworm-updates main",
        f"deb {keyring} {archive.url}/debian-security bookworm-security main",
    ]
    assert (state / "status").read_text() == ""
    # What apt itself makes of the options (apt-config reads them as apt-get does): nothing of the system's state,
    # sources or preferences.
    config = sh(archive, 'apt-get() { apt-config "$@"; }; debian_apt bookworm dump').stdout
    for key, want in (
        ("Dir::State::status", state / "status"),
        ("Dir::Etc::sourcelist", state / "sources.list"),
        ("Dir::Etc::sourceparts", state / "sources.list.d"),
        ("Dir::Etc::preferences", state / "preferences"),
        ("Dir::Etc::preferencesparts", state / "preferences.d"),
        ("Dir::State::lists", state / "lists"),
    ):
        assert f'{key} "{want}";' in config.splitlines(), (key, config)
    # apt's own view: the package's installed version is none, the candidate the archive's.
    policy = sh(archive, 'apt-get() { apt-cache "$@"; }; debian_apt bookworm policy fonts-demo').stdout
    assert "Installed: (none)" in policy and "Candidate: 1.0-1+deb12u2" in policy, policy


def test_upgradable_lists_what_the_updates_have_newer(archive: Archive) -> None:
    assert sh(archive, "debian_update bookworm >/dev/null").returncode == 0
    image = archive.home / "image-status"
    image.write_text(status({"fonts-demo": "1.0-1", "libjs-demo": "2.0-1", "tool-demo": "1.0-1"}))
    done = sh(archive, 'debian_upgradable bookworm "$1"', str(image))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["fonts-demo 1.0-1 1.0-1+deb12u2", "tool-demo 1.0-1 1.0-1+deb12u1"]
    image.write_text(status({"fonts-demo": "1.0-1+deb12u2", "libjs-demo": "2.0-1", "tool-demo": "1.0-1+deb12u1"}))
    done = sh(archive, 'debian_upgradable bookworm "$1"', str(image))
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_the_archive_is_the_first_that_serves_debians_suite(archive: Archive) -> None:
    found = sh(archive, 'debian_archive_among bookworm-security "$@"', f"{archive.url}/missing",
               f"{archive.url}/vendor/debian/", f"{archive.url}/debian", f"{archive.url}/debian-security/")  # fmt: skip
    assert found.returncode == 0 and found.stdout == f"{archive.url}/debian-security\n", found.stdout + found.stderr
    none = sh(archive, 'debian_archive_among bookworm-security "$@"', f"{archive.url}/vendor/debian")
    assert none.returncode == 1 and none.stdout == ""


def test_the_mirrors_are_the_variables_when_set(archive: Archive) -> None:
    done = sh(archive, "debian_mirror; debian_security_mirror")
    assert done.stdout.splitlines() == [f"{archive.url}/debian", f"{archive.url}/debian-security"]
