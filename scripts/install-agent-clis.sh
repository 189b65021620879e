#!/usr/bin/env bash
# Install the real agent CLIs that tests/test_real_clis.py drives, pinned to the versions measured in
# shared/agent-clis/README.md, into a cache OUTSIDE the repo so a re-run on the same machine (or a reused CI
# machine) installs nothing.
#
#   scripts/install-agent-clis.sh            # prints the bin dir (and only that) on stdout
#   BIN=$(scripts/install-agent-clis.sh)     # report goes to stderr
#   scripts/install-agent-clis.sh --latest   # the registry's newest of each instead, in a cache of its own
#                                            # (default ~/.cache/proctor/agent-clis-latest): `make test-latest-clis`
#
# Layout of ${PROCTOR_CLI_CACHE:-$HOME/.cache/proctor/agent-clis}:
#   pkgs/<name>/          one npm prefix per CLI, so one failed install never touches the others
#   pkgs/<name>/.proctor-installed   "<package>@<version>", written only after a successful install
#   bin/<name>            symlink to pkgs/<name>/node_modules/.bin/<name>; present only when installed
#
# Idempotent: a CLI whose stamp names the pinned version and whose executable exists is skipped. A failed
# install is reported and the others go on; the exit status is 0 when at least one CLI is installed, 1 when
# none is (or node/npm is missing), so a registry outage on a cold machine is not silently "all skipped".
set -uo pipefail

LATEST=0
case "${1:-}" in
  --latest) LATEST=1 ;;
  "") ;;
  *) printf 'usage: %s [--latest]\n' "$0" >&2; exit 2 ;;
esac
if [ "$LATEST" = 1 ]; then
  DIR="${PROCTOR_CLI_CACHE:-$HOME/.cache/proctor/agent-clis-latest}"
else
  DIR="${PROCTOR_CLI_CACHE:-$HOME/.cache/proctor/agent-clis}"
fi
NPM_TIMEOUT="${PROCTOR_CLI_NPM_TIMEOUT:-900}"

# name|package|version (the version npm resolves; codex-cli 0.171.0 is @openai/codex@0.171.0). Each pinned
# version is in its adapter's `tested` list (builtin.toml), as the CLI's --version names it; a test holds
# the two together.
PINS=(
  "codex|@openai/codex|0.171.0"
  "claude|@anthropic-ai/claude-code|2.1.332"
  "gemini|@google/gemini-cli|0.61.0"
  "grok|@vibe-kit/grok-cli|0.0.34"
  "opencode|opencode-ai|1.18.33"
)

log() { printf '%s\n' "$*" >&2; }

if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
  log "install-agent-clis: node and npm are required (apt-get install -y nodejs npm; node >= 20)"
  exit 1
fi

node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if [ "$node_major" -lt 20 ]; then
  # @google/gemini-cli 0.61.0 declares engines node >= 20; Debian bookworm's apt nodejs is 18.
  log "install-agent-clis: WARNING: node $(node --version) is older than 20: gemini will not run" \
      "(the others need >= 18); use a node 20 build (e.g. nodesource nodejs 20.x, which bundles npm)"
fi

mkdir -p "$DIR/pkgs" "$DIR/bin" || { log "install-agent-clis: cannot create $DIR"; exit 1; }

# Two CI jobs on one machine must not install into the same prefix at once.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$DIR/.lock"
  flock -w 1800 9 || { log "install-agent-clis: timed out waiting for the lock on $DIR/.lock"; exit 1; }
fi

installed_version() {  # the version npm actually put in the prefix, or nothing
  local pj="$1/node_modules/$2/package.json"
  [ -f "$pj" ] && node -e 'process.stdout.write(String(require(process.argv[1]).version||""))' "$pj" 2>/dev/null
}

ok=() failed=() reused=()
for pin in "${PINS[@]}"; do
  IFS='|' read -r name pkg version <<<"$pin"
  if [ "$LATEST" = 1 ]; then
    version=$(timeout 120 npm view "$pkg" version 2>/dev/null | tail -n 1)
    if [ -z "$version" ]; then
      failed+=("$name"); log "install-agent-clis: $name: the registry did not say $pkg's latest version"
      continue
    fi
  fi
  prefix="$DIR/pkgs/$name"
  want="$pkg@$version"
  exe="$prefix/node_modules/.bin/$name"

  if [ "$(cat "$prefix/.proctor-installed" 2>/dev/null)" = "$want" ] && [ -x "$exe" ] \
     && [ "$(installed_version "$prefix" "$pkg")" = "$version" ]; then
    ln -sfn "../pkgs/$name/node_modules/.bin/$name" "$DIR/bin/$name"
    reused+=("$name"); ok+=("$name")
    log "install-agent-clis: $name: $want already cached"
    continue
  fi

  # A different or half-finished version: start that prefix over, and drop the bin link until it works.
  rm -f "$DIR/bin/$name"
  rm -rf "$prefix"
  mkdir -p "$prefix"
  start=$(date +%s)
  log "install-agent-clis: $name: installing $want ..."
  if timeout "$NPM_TIMEOUT" npm install --prefix "$prefix" --no-audit --no-fund \
        --loglevel=error "$want" >"$prefix/.npm-install.log" 2>&1 \
     && [ -x "$exe" ] && [ "$(installed_version "$prefix" "$pkg")" = "$version" ]; then
    printf '%s\n' "$want" >"$prefix/.proctor-installed"
    ln -sfn "../pkgs/$name/node_modules/.bin/$name" "$DIR/bin/$name"
    ok+=("$name")
    log "install-agent-clis: $name: installed $want in $(( $(date +%s) - start ))s"
  else
    failed+=("$name")
    log "install-agent-clis: $name: FAILED to install $want after $(( $(date +%s) - start ))s;" \
        "last lines of $prefix/.npm-install.log:"
    tail -n 15 "$prefix/.npm-install.log" 2>/dev/null | sed 's/^/    /' >&2
  fi
done

log "install-agent-clis: installed: ${ok[*]:-none} (reused from cache: ${reused[*]:-none});" \
    "failed: ${failed[*]:-none}"
printf '%s\n' "$DIR/bin"
[ "${#ok[@]}" -gt 0 ]
