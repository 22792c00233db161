// MPI for `mpirun -np N kvlens eval ...`: one shard per rank, rank 0 gathers the records and
// writes the table. kvlens initializes MPI only when a launcher started it (mpirun sets
// OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK), and builds without MPI when it is not
// installed (then every process is a world of one).
#pragma once
#include <string>
#include <vector>

namespace kvlens::app {

struct MpiWorld {
  int rank = 0, size = 1;
  bool active() const { return size > 1; }
};

// Called first and last in main(). mpi_abort ends every rank (after an error in one of them).
void mpi_start(int& argc, char**& argv);
void mpi_finish();
[[noreturn]] void mpi_abort(int code);
// main()'s exit: MPI finalized after success; after a failure under mpirun every rank is
// stopped (a rank waiting for the failed one would wait for ever).
int mpi_exit(int code);
const MpiWorld& mpi_world();
bool mpi_built();
// Started by an MPI launcher although this kvlens was built without MPI.
bool mpi_launched_without_support();

// Rank 0 receives every rank's string, in rank order; the other ranks receive nothing.
std::vector<std::string> mpi_gather(const std::string& mine);

}  // namespace kvlens::app
