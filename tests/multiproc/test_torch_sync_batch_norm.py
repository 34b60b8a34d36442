"""hora.torch.SyncBatchNorm on 3 real ranks equals torch's BatchNorm on the concatenated batch:
outputs, input and parameter gradients, running statistics, and eval mode, for every
BatchNorm dimension, with and without affine parameters or running statistics, in float32
and float64, and with a rank that holds no rows."""
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import run_ranks  # noqa: E402

SEED = 1234


# -- SyncBatchNorm ---------------------------------------------------------------------------
BN_SIZES = [2, 5, 3]                     # rows of the global batch held by ranks 0, 1, 2
BN_CASES = {
    # name: (torch class, input shape after N, dtype, kwargs, rows per rank)
    "1d_flat": ("BatchNorm1d", (4,), torch.float64, {}, BN_SIZES),
    "1d_seq": ("BatchNorm1d", (4, 3), torch.float64, {"momentum": None}, BN_SIZES),
    "2d": ("BatchNorm2d", (4, 3, 2), torch.float64, {}, BN_SIZES),
    "3d_no_affine": ("BatchNorm3d", (4, 2, 2, 2), torch.float64, {"affine": False}, BN_SIZES),
    "2d_empty_rank": ("BatchNorm2d", (4, 3, 2), torch.float64, {}, [0, 4, 3]),
    "2d_float32": ("BatchNorm2d", (4, 3, 2), torch.float32, {}, BN_SIZES),
    "2d_no_running": ("BatchNorm2d", (4, 3, 2), torch.float64,
                      {"track_running_stats": False}, BN_SIZES),
}


def _amax(t):
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _sync_bn_job():
    import hora.torch as hvd
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {}
    for name, (cls, shape, dtype, kw, sizes) in BN_CASES.items():
        ref = getattr(torch.nn, cls)(shape[0], **kw).to(dtype)
        bn = hvd.SyncBatchNorm(shape[0], **kw).to(dtype)
        if ref.affine:
            with torch.no_grad():
                ref.weight.uniform_(0.5, 1.5)
                ref.bias.uniform_(-0.5, 0.5)
        bn.load_state_dict(ref.state_dict())
        lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
        diffs = []
        for it in range(2):                  # twice: running statistics accumulate
            g = torch.Generator().manual_seed(SEED + it)
            x = (torch.randn(sum(sizes), *shape, generator=g) * 3 + 1).to(dtype)
            upstream = torch.randn(x.shape, generator=g).to(dtype)
            xr = x.clone().requires_grad_()
            ref.zero_grad()
            y_ref = ref(xr)
            (y_ref * upstream).sum().backward()
            xm = x[lo:hi].clone().requires_grad_()
            bn.zero_grad()
            y = bn(xm)
            (y * upstream[lo:hi]).sum().backward()
            diffs.append(_amax(y - y_ref[lo:hi]))
            diffs.append(_amax(xm.grad - xr.grad[lo:hi]))
            if ref.affine:                   # local parameter gradients add up to torch's
                for p, q in ((bn.weight, ref.weight), (bn.bias, ref.bias)):
                    diffs.append(_amax(hvd.allreduce(p.grad, op=hvd.Sum) - q.grad))
            if ref.track_running_stats:
                diffs.append(_amax(bn.running_mean - ref.running_mean))
                diffs.append(_amax(bn.running_var - ref.running_var))
        bn.eval()
        ref.eval()
        x = torch.randn(3, *shape).to(dtype)
        diffs.append(_amax(bn(x) - ref(x)))      # eval: no communication, so a local input
        out[name] = max(diffs)
    return out


@pytest.mark.timeout(90)
def test_sync_batch_norm_equals_batch_norm_on_the_concatenated_batch():
    results = run_ranks(_sync_bn_job, 3, timeout_s=80)
    for rank, res in enumerate(results):
        for name, (_, _, dtype, _, _) in BN_CASES.items():
            tol = 1e-9 if dtype == torch.float64 else 1e-4
            assert res[name] < tol, f"{name}: rank {rank} is {res[name]:.3g} from torch"
