"""``python -m hora`` and the ``hora`` console script: the runner's command line (``hora
run``) with the commands beside and above it (``hora bench``; ``hora timeline``; ``hora k8s``;
``hora run`` inside SageMaker).

The package's face, so it may compose layers that must not import each other.
"""
import sys


def main(argv=None):
    from hora.bench import add_command as bench_command
    from hora.core.timeline import add_command as timeline_command
    from hora.integrations import commands
    from hora.runner.cli import main as runner_main
    return runner_main(argv, extra_commands=(bench_command, timeline_command, *commands()))


if __name__ == "__main__":
    sys.exit(main())
