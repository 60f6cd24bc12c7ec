"""backends/ installs as shardfuse.backends, never as a top-level `backends`."""
import importlib.util
from pathlib import Path


def test_backends_import_as_subpackage():
    import shardfuse.backends.numpy_local as m

    assert Path(m.__file__).parent.name == "backends"
    assert m.__name__ == "shardfuse.backends.numpy_local"


def test_ci_runs_the_readme_test_command():
    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.endswith("python -m pytest") and l.startswith("python3 -m venv"))
    assert line in (root / ".ci" / "run").read_text()
