// Guard pages: a test mode in which every buffer moecert allocates (and,
// in programs that link the replacement operator new, every heap block)
// touches an inaccessible page, so that a read or write past its end (or
// before its start) faults at once.
#pragma once

#include <cstddef>

namespace moecert {

/// Where a buffer meets its inaccessible (PROT_NONE) page:
///  - off:   ordinary allocation;
///  - end:   the buffer ends where the page begins (the end is rounded up to
///           the buffer's alignment: 16 bytes for operator new, 64 for
///           moecert's packed weights and workspaces);
///  - start: the buffer begins where the page ends.
/// Freed blocks become inaccessible and their addresses are not reused, so
/// a use after free faults too. Slow (a system call per allocation): for
/// tests, fuzz replay and `moecert conform --guard-pages`, not production.
enum class GuardPages { off, end, start };

/// The mode for allocations from now on. Initially MOECERT_GUARD_PAGES
/// (off|end|start; unset: off). A block is freed the way it was allocated
/// whatever the mode is by then. Thread-safe.
void set_guard_pages(GuardPages mode);
GuardPages guard_pages();
/// Throws std::invalid_argument naming MOECERT_GUARD_PAGES and the valid
/// values if it holds anything else (guard_pages() is then off); moecert's
/// allocations and the moecert tool call it, so a mistyped test mode stops
/// the run instead of passing it unguarded.
void check_guard_pages_environment();

/// Parses "off", "end" or "start"; false for anything else.
bool parse_guard_pages(const char* text, GuardPages& out);

}  // namespace moecert
