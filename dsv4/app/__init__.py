"""The application: the command line (cli), a composed config made into a typed job, the modes, a run as
build -> run -> grade -> report, tensor-parallel ranks, run folders and dumps."""
