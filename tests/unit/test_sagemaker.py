"""SageMaker containers, read from a fake /opt/ml tree (HORA_SAGEMAKER_ROOT / root=)."""
import pytest

import hora.data as data
from hora.core.sagemaker import DEFAULT_RENDEZVOUS_PORT, read_sagemaker_env
from hora.core.topology import detect_placement
from hora.errors import SageMakerConfigError, SharedPipeError
from tests.sagemaker_tree import make_tree

pytestmark = pytest.mark.timeout(30)

HOSTS = ["algo-1", "algo-2", "algo-3"]


def test_outside_sagemaker_there_is_nothing(tmp_path):
    assert read_sagemaker_env(tmp_path, env={}) is None


def test_config_and_mpi_hyperparameters(tmp_path):
    make_tree(tmp_path, HOSTS, "algo-2", {
        "sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 4,
        "sagemaker_mpi_custom_mpi_options": "-x FOO=1", "epochs": 3, "lr": 0.1},
        {"train": "File"})
    sm = read_sagemaker_env(tmp_path, env={"SM_NUM_GPUS": "8"})
    assert sm.hosts == tuple(HOSTS) and sm.current_host == "algo-2" and sm.host_index == 1
    assert sm.mpi_enabled and sm.processes_per_host == 4 and sm.num_processes == 12
    assert sm.custom_mpi_options == "-x FOO=1"
    assert sm.hyperparameters["epochs"] == 3 and sm.hyperparameters["lr"] == 0.1
    assert sm.channel_dir("train") == tmp_path / "input" / "data" / "train"
    assert sm.model_dir == tmp_path / "model"


def test_processes_per_host_default_to_gpus_then_one(tmp_path):
    make_tree(tmp_path, HOSTS, "algo-1")
    assert read_sagemaker_env(tmp_path, env={"SM_NUM_GPUS": "8"}).processes_per_host == 8
    assert read_sagemaker_env(tmp_path, env={}).processes_per_host == 1
    make_tree(tmp_path, HOSTS, "algo-1", {"sagemaker_mpi_num_of_processes_per_host": 2,
                                          "sagemaker_mpi_num_processes": 5})
    assert read_sagemaker_env(tmp_path, env={}).num_processes == 5


@pytest.mark.parametrize("hyper,fragment", [
    ({"sagemaker_mpi_num_of_processes_per_host": 0}, "processes_per_host=0"),
    ({"sagemaker_mpi_num_processes": 7}, "sagemaker_mpi_num_processes=7"),
])
def test_bad_hyperparameters_are_named(tmp_path, hyper, fragment):
    make_tree(tmp_path, HOSTS, "algo-1", hyper)
    with pytest.raises(SageMakerConfigError, match=fragment):
        read_sagemaker_env(tmp_path, env={}).num_processes


def test_broken_files_are_named(tmp_path):
    make_tree(tmp_path, HOSTS, "algo-9")
    with pytest.raises(SageMakerConfigError, match="algo-9"):
        read_sagemaker_env(tmp_path, env={})
    (tmp_path / "input" / "config" / "resourceconfig.json").write_text("{not json")
    with pytest.raises(SageMakerConfigError, match="resourceconfig.json"):
        read_sagemaker_env(tmp_path, env={})


def test_sm_variables_without_files(tmp_path):
    env = {"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-2",
           "SM_MODEL_DIR": str(tmp_path / "m"), "SM_CHANNEL_TRAIN": str(tmp_path / "t")}
    sm = read_sagemaker_env(tmp_path, env=env)
    assert sm.host_index == 1 and sm.model_dir == tmp_path / "m"
    assert sm.channel_dir("train") == tmp_path / "t"


def test_init_places_one_rank_per_host(tmp_path):
    make_tree(tmp_path, HOSTS, "algo-3")
    p = detect_placement({"HORA_SAGEMAKER_ROOT": str(tmp_path), "TRAINING_JOB_NAME": "j"})
    assert (p.rank, p.size, p.local_rank, p.local_size, p.source) == (2, 3, 0, 1, "sagemaker")
    assert (p.rendezvous_addr, p.rendezvous_port, p.serve_rendezvous) == (
        "algo-1", DEFAULT_RENDEZVOUS_PORT, True)
    other = detect_placement({"HORA_SAGEMAKER_ROOT": str(tmp_path), "TRAINING_JOB_NAME": "k"})
    assert other.secret != p.secret           # separate jobs do not share a secret
    # a launcher's environment wins over the container's files
    p = detect_placement({"HORA_SAGEMAKER_ROOT": str(tmp_path), "OMPI_COMM_WORLD_RANK": "5",
                          "OMPI_COMM_WORLD_SIZE": "6"})
    assert (p.rank, p.size, p.source) == (5, 6, "mpirun")


def test_each_rank_its_own_pipe_channel(tmp_path):
    make_tree(tmp_path, ["algo-1"], "algo-1", channels={f"train_{r}": "Pipe" for r in range(4)})
    for r in range(4):
        path = data.sagemaker_channel("train", epoch=1, root=tmp_path, rank=r, local_size=4)
        assert path == tmp_path / "input" / "data" / f"train_{r}_1"


def test_two_ranks_on_one_shared_fifo_is_an_error(tmp_path):
    make_tree(tmp_path, ["algo-1"], "algo-1", channels={"train": "Pipe"})
    with pytest.raises(SharedPipeError, match=r"'train'.*2 ranks on host algo-1"):
        data.sagemaker_channel("train", root=tmp_path, rank=1, local_size=2)
    # one reader per host is how Pipe mode is meant to be used
    assert data.sagemaker_channel("train", root=tmp_path, rank=0, local_size=1) == \
        tmp_path / "input" / "data" / "train_0"
    with pytest.raises(SageMakerConfigError, match="Pipe mode"):
        data.sagemaker_files("train", root=tmp_path, rank=0, size=1)


def test_file_channel_is_sharded_or_per_rank(tmp_path):
    make_tree(tmp_path, ["algo-1"], "algo-1", channels={"train": "File", "val_0": "File",
                                                        "val_1": "File"})
    files = sorted(str(tmp_path / "input" / "data" / "train" / f"f{i}") for i in range(5))
    for f in files:
        open(f, "w").close()
    (tmp_path / "input" / "data" / "val_1" / "mine").write_text("")
    shares = [list(data.sagemaker_files("train", root=tmp_path, rank=r, size=2))
              for r in range(2)]
    assert shares == [files[0::2], files[1::2]]
    assert list(data.sagemaker_files("val", root=tmp_path, rank=1, size=2)) == [
        str(tmp_path / "input" / "data" / "val_1" / "mine")]
    assert data.sagemaker_channel("train", root=tmp_path, rank=1, local_size=2) == \
        tmp_path / "input" / "data" / "train"
    with pytest.raises(SageMakerConfigError, match="no channel 'test_0' or 'test'"):
        data.sagemaker_channel("test", root=tmp_path, rank=0, local_size=1)


def test_not_in_sagemaker_is_a_clear_error(tmp_path):
    with pytest.raises(SageMakerConfigError, match="resourceconfig.json does not exist"):
        data.sagemaker_channel("train", root=tmp_path, rank=0, local_size=1)
