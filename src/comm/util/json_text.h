// JSON text by hand, for the writers that do not take a JSON library (the metrics log, the flight
// recorder's dumps, the timeline's headers): one string escaper for all of them. Internal to dtrain.
#pragma once
#include <string>
#include <string_view>

namespace dtrain::detail {

// Appends s as a JSON string literal: quotes, backslashes and control characters escaped (\n, \r, \t
// short, the rest \u00XX); other bytes (UTF-8) as they are.
void appendJsonQuoted(std::string& out, std::string_view s);
// The same, as a new string.
std::string jsonQuoted(std::string_view s);

}  // namespace dtrain::detail
