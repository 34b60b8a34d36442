import argparse

import numpy as np

import hora

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()

hora.init()
grad = np.full(4, float(hora.rank()), dtype=np.float32)
avg = hora.allreduce(grad, op=hora.Average, name="grad")
if hora.rank() == 0:
    print(f"{hora.size()} ranks, lr {args.lr}, average gradient {avg}")
hora.shutdown()
