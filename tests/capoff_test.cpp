// Built against the library compiled at contract cap `off` (and with the
// cap off in this file): checks must be absent, not merely skipped.
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/engine.hpp"
#include "moecert/config.hpp"
#include "test_util.hpp"

using namespace moecert;

static_assert(MOECERT_CONTRACT_CAP_LEVEL == 0, "this test must be built at cap off");

// Declared, never defined: if a clause body referring to it were compiled,
// this test would not link.
void moecert_capoff_probe_never_defined();

TEST_CASE("core.contracts.cap: at cap off clause bodies are not compiled",
          "[core][contracts][cap]") {
  detail::Checker c{"test.capoff"};
  MOECERT_CONTRACT(c, clauses::config::kExpertsRange) { moecert_capoff_probe_never_defined(); }
  CHECK(contract_level_cap() == Level::off);
}

TEST_CASE("core.contracts.cap: at cap off the library checks nothing, whatever the level",
          "[core][contracts][cap]") {
  MoeConfig bad;  // every field invalid
  bad.topk = -1;
  reset_clause_counts();
  ContractScope scope{Level::full, Semantic::enforce};
  CHECK(effective_contract_settings().level == Level::off);  // clamped to the cap
  CHECK_NOTHROW(validate(bad));
  CHECK(clause_counts().empty());
}
