"""A fake SageMaker ``/opt/ml`` tree for tests: the config files SageMaker writes."""
import json
import os


def make_tree(root, hosts, current_host, hyperparameters=None, channels=None):
    """Write ``root/input/config/*.json`` and return ``root``.

    Args:
        channels: ``{name: mode}`` ("File" or "Pipe"), or ``{name: {settings}}``.
    """
    conf = root / "input" / "config"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "resourceconfig.json").write_text(json.dumps(
        {"current_host": current_host, "hosts": list(hosts), "network_interface_name": "eth0"}))
    # SageMaker passes every hyperparameter value as a string
    (conf / "hyperparameters.json").write_text(json.dumps(
        {k: v if isinstance(v, str) else json.dumps(v)
         for k, v in (hyperparameters or {}).items()}))
    config = {}
    for name, mode in (channels or {}).items():
        settings = mode if isinstance(mode, dict) else {"TrainingInputMode": mode}
        config[name] = {"ContentType": "application/x-recordio", "RecordWrapperType": "None",
                        "S3DistributionType": "FullyReplicated", **settings}
        if config[name]["TrainingInputMode"] == "Pipe":
            for epoch in range(2):
                path = root / "input" / "data" / f"{name}_{epoch}"
                path.parent.mkdir(parents=True, exist_ok=True)
                os.mkfifo(path)
        else:
            (root / "input" / "data" / name).mkdir(parents=True, exist_ok=True)
    (conf / "inputdataconfig.json").write_text(json.dumps(config))
    (root / "model").mkdir(exist_ok=True)
    return root
