# Sourced by the benchmark scripts: PEER_PYTHON, the Python whose torch the PyTorch peer drivers
# (benches/peers/*.py) run on. Today's PyTorch is the anchor: the pinned torch wheel in the repository's
# .venv (scripts/setup.sh) when it is there, else Debian's /usr/bin/python3 (python3-torch 1.13), which the
# figures in docs/PERFORMANCE.md "against PyTorch 1.13" used. $PEER_PYTHON chooses another.
#   source "$root/benches/peer_python.sh"; "$PEER_PYTHON" "$root/benches/peers/torch_ddp.py" 2 20
_peer_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PEER_PYTHON:-} ]]; then
  PEER_PYTHON=/usr/bin/python3
  [[ -x $_peer_root/.venv/bin/python ]] && PEER_PYTHON=$_peer_root/.venv/bin/python
fi
# "torch 2.15.0+cu132 (/path/to/python)", for the reports' headers.
PEER_TORCH="torch $("$PEER_PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?') ($PEER_PYTHON)"
unset _peer_root
