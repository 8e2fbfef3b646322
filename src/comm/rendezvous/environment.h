// The process environment as dtrain sees it: every variable dtrain reads, taken once by
// Environment::read() (the one reader of the environment in src/) into a plain value. Parsing functions take an
// Environment, so they are tested on values built in the test, without setenv:
//
// \code
//   auto env = rendezvous::Environment::of({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
//   WorldInfo w = rendezvous::detectWorld(env, InitOptions{});   // w.rank == 1
// \endcode
//
// Internal to dtrain (the comm layer and the torch layer's parameter server), not public API.
#pragma once
#include <map>
#include <string>

namespace dtrain::comm::rendezvous {

class Environment {
 public:
  // This process's values of the variables dtrain reads (kVariables in environment.cc).
  static Environment read();
  // Given values. Every name must be one dtrain reads (a misspelt name would silently be unset):
  // dtrain::Error naming it otherwise.
  static Environment of(std::map<std::string, std::string> values);
  // No variable set.
  Environment() = default;

  // The value, or nullptr when the variable is unset or empty. `name` must be one dtrain reads. The
  // pointer lives as long as this Environment: keep it in a variable (read().get(...) dangles).
  const char* get(const char* name) const;
  // An integer in [min_value, 2^24]; `dflt` when unset; RendezvousError naming the variable otherwise.
  int integer(const char* name, int dflt, int min_value) const;
  // True when the variable is exactly "1".
  bool flag(const char* name) const;
  // "[rank r] " from the first of RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID that is set, for messages
  // written before the world is known; "" when none is.
  std::string rankPrefix() const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace dtrain::comm::rendezvous
