// How store keys appear in error messages, shared by every store.
#pragma once
#include <string>
#include <vector>

namespace dtrain::comm {

// Quoted, non-printable bytes escaped, long keys shortened: 'addr/3', 'k\x00', 'kkkk...'...(4097 bytes).
std::string quoteKey(const std::string& s);
// The first 16 keys, quoted, then " and N more".
std::string quoteKeys(const std::vector<std::string>& keys);

}  // namespace dtrain::comm
