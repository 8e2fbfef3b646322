"""The package itself: a build for another torch minor refuses to load, naming both versions."""
import subprocess
import sys

STUB = """
import sys, types
import torch
stub = types.ModuleType("dtrain._C")
stub.torch_version = "2.1.0"      # as if built against another torch
stub.version = "0.1.0"
sys.modules["dtrain._C"] = stub
try:
    import dtrain
except ImportError as e:
    print("ImportError:", e)
    sys.exit(0)
sys.exit("imported a build for another torch")
"""


def test_a_build_for_another_torch_refuses_to_load():
    import torch
    out = subprocess.run([sys.executable, "-c", STUB], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"dtrain was built against torch 2.1.0, but torch {torch.__version__} is installed" in out.stdout, out.stdout
    assert "reinstall dtrain in this environment" in out.stdout, out.stdout
