#include "app/cli/mpi_world.h"

#include <cstdlib>

#ifdef KVLENS_MPI
#include <mpi.h>
#endif

#include "core/errors.h"

namespace kvlens::app {

namespace {
MpiWorld g_world;
#ifdef KVLENS_MPI
bool g_started = false;
#endif

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}
}  // namespace

const MpiWorld& mpi_world() { return g_world; }

int mpi_exit(int code) {
  if (code != 0 && g_world.active()) mpi_abort(code);
  mpi_finish();
  return code;
}
bool mpi_launched_without_support() { return !mpi_built() && launched_by_mpi(); }

#ifdef KVLENS_MPI

bool mpi_built() { return true; }

void mpi_start(int& argc, char**& argv) {
  if (!launched_by_mpi()) return;
  MPI_Init(&argc, &argv);
  g_started = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world.size);
}

void mpi_finish() {
  if (g_started) MPI_Finalize();
  g_started = false;
}

void mpi_abort(int code) {
  if (g_started) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

std::vector<std::string> mpi_gather(const std::string& mine) {
  if (!g_world.active()) return {mine};
  int n = static_cast<int>(mine.size());
  std::vector<int> sizes(g_world.size), offsets(g_world.size);
  MPI_Gather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::string all;
  if (g_world.rank == 0) {
    long total = 0;
    for (int r = 0; r < g_world.size; ++r) {
      offsets[r] = static_cast<int>(total);
      total += sizes[r];
    }
    if (total > 2000000000L) throw InputError("MPI: the gathered records exceed 2 GB; use --shard and kvlens merge");
    all.resize(static_cast<size_t>(total));
  }
  MPI_Gatherv(mine.data(), n, MPI_CHAR, all.data(), sizes.data(), offsets.data(), MPI_CHAR, 0, MPI_COMM_WORLD);
  std::vector<std::string> out;
  if (g_world.rank == 0)
    for (int r = 0; r < g_world.size; ++r) out.push_back(all.substr(offsets[r], sizes[r]));
  return out;
}

#else

bool mpi_built() { return false; }
void mpi_start(int&, char**&) {}
void mpi_finish() {}
void mpi_abort(int code) { std::exit(code); }
std::vector<std::string> mpi_gather(const std::string& mine) { return {mine}; }

#endif

}  // namespace kvlens::app
