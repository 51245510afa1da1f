"""The commands in scripts/ as tests see them: each is an argument parser over a study in hf_paged.evaluation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module (its argument parser and constants), without running its command."""
    spec = importlib.util.spec_from_file_location(f"{name}_script_for_tests", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Command:
    """scripts/<name>.py over its study module: ``parse_args`` is the script's, ``main(argv)`` parses ``argv`` and
    runs the study; every other attribute is the study's."""

    def __init__(self, name: str, study):
        self.study = study
        self.parse_args = load_script(name).parse_args

    def main(self, argv):
        return self.study.main(self.parse_args(argv))

    def __getattr__(self, name):
        return getattr(self.study, name)
