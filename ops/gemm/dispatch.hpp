// Internals of ISA dispatch exposed for tests.
#pragma once

#include <optional>

#include "moecert/types.hpp"

namespace moecert::detail {

/// The ISA that MOECERT_ISA=env forces: nullopt when env is null or empty;
/// std::invalid_argument naming the valid choices when env is unknown or
/// names a level this machine cannot run (no AMX instruction ever runs on a
/// machine without AMX, whatever the environment says).
std::optional<Isa> resolve_forced_isa(const char* env);

}  // namespace moecert::detail
