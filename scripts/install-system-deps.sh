#!/usr/bin/env bash
# Installs the Debian packages the test suite drives for real, only those missing. Needs root (CI is root).
#   git, bubblewrap (confinement), sqlite3 (the ledger-tamper tests edit with the real CLI),
#   a C compiler and the kernel headers (the Landlock exec helper is compiled on first use),
#   cargo (the Rust ecosystem test; its crate comes from Debian's archive with `apt-get download`),
#   golang-go (the Go ecosystem test: a vendored module; about 60 MB, 8 s to install here),
#   chromium and a font (the review page's browser tests drive Debian's chromium through Playwright).
# Node.js >= 20 with npm is expected from the machine image: Debian bookworm's nodejs is 18, too old for
# gemini-cli 0.61, so it is not installed from here.
set -euo pipefail
need=()
command -v git >/dev/null || need+=(git)
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v sqlite3 >/dev/null || need+=(sqlite3)
command -v cc >/dev/null || need+=(gcc)
[ -f /usr/include/linux/landlock.h ] || need+=(linux-libc-dev)
[ -f /usr/include/stdio.h ] || need+=(libc6-dev)
command -v flock >/dev/null || need+=(util-linux)
# cargo/rustc: tests/test_ecosystems.py runs a real crate's `cargo test` (a rustup install counts).
command -v cargo >/dev/null || [ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo" ] || need+=(cargo)
# go: tests/test_ecosystems.py tests a vendored Go module offline with `go test`.
command -v go >/dev/null || need+=(golang-go)
# chromium: tests/test_review_browser.py (Playwright from pip drives it; no browser is downloaded).
command -v chromium >/dev/null || need+=(chromium)
[ -d /usr/share/fonts/truetype/dejavu ] || need+=(fonts-dejavu-core)
if ! command -v npm >/dev/null || ! node -e 'process.exit(+process.versions.node.split(".")[0] >= 20 ? 0 : 1)' 2>/dev/null; then
  echo "warning: Node.js >= 20 with npm is missing; the real-CLI tests will skip" >&2
fi
if [ ${#need[@]} -eq 0 ]; then
  echo "system deps present" >&2
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages: ${need[*]} (run as root, or install them)" >&2
  exit 1
fi
echo "installing: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
