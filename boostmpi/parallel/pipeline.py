"""The 1F1B pipeline schedule, as data: a list of ("F", micro_batch) / ("B", micro_batch) per stage.

Stage s of S first runs min(S - s - 1, M) forward passes (warm-up), then alternates one forward
and one backward (steady state), then drains the remaining backward passes (cool-down). Every
stage holds at most S - s micro-batches of activations at once, instead of M under GPipe.
"""


def one_f_one_b(n_stages, stage, n_micro):
    warmup = min(n_stages - stage - 1, n_micro)
    steps = [("F", mb) for mb in range(warmup)]
    for i in range(n_micro - warmup):
        steps.append(("F", warmup + i))
        steps.append(("B", i))
    steps.extend(("B", mb) for mb in range(n_micro - warmup, n_micro))
    return steps

