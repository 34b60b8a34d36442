import numpy as np

import hora
import hora.elastic

hora.init()
weights = np.zeros(4)
state = hora.elastic.ObjectState(hora.broadcast_object, hora.rank, weights=weights, epoch=0)


@hora.elastic.run
def train(state):
    for state.epoch in range(state.epoch, 5):
        grad = np.ones(4) * (hora.rank() + 1)
        state.weights = state.weights - 0.1 * hora.allreduce(grad, op=hora.Average,
                                                            name="grad")
        state.commit()          # a copy in memory; the job re-forms here when hosts changed
    return state.weights


weights = train(state)
if hora.rank() == 0:
    print(f"trained on {hora.size()} ranks: {weights}")
