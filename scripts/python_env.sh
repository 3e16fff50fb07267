# Sourced by setup.sh and test.sh: where the Python environment of the package's tests lives. One
# virtual environment per machine (torch is ~5 GB with its CUDA libraries), outside the clone, so that
# every clone and CI run reuses it; TREECP_VENV overrides the place.
TREECP_VENV="${TREECP_VENV:-$HOME/.cache/treecp/venv}"
# What the Python tests and `pip install --no-build-isolation .` need.
TREECP_PY_PACKAGES=(torch numpy pytest nanobind scikit-build-core)
