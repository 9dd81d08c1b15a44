"""The rank side: the loop every MPI rank runs (scheduler, model runner, sampler, CUDA graphs, KV
pool), how it is built, and the rank entry points."""
