"""The README opens with the two commands for a fresh machine, and CI runs the second."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_train_and_test_commands():
    train, test = _commands()[:2]
    assert "hora run -np 2" in train and train.startswith("pip install")
    assert "pytest" in test and test.startswith("pip install")


def test_ci_runs_the_readme_test_command():
    test = _commands()[1]
    assert test in (ROOT / ".ci" / "run").read_text()
