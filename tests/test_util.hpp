// Helpers shared by the Catch2 tests.
#pragma once

#include <catch2/catch.hpp>
#include <functional>
#include <string>

#include "moecert/contracts.hpp"

namespace moecert::test {

/// Runs `fn` under enforce at `level` and returns the violation it must
/// throw; fails the test if it throws nothing or another clause.
inline Violation expect_violation(const std::function<void()>& fn, std::string_view clause,
                                  Level level = Level::full) {
  ContractScope scope{level, Semantic::enforce};
  try {
    fn();
  } catch (const ContractViolation& v) {
    INFO(v.what());
    CHECK(v.clause() == clause);
    return v.violation();
  }
  FAIL("expected a violation of " << clause << ", none was raised");
  return {};
}

}  // namespace moecert::test
