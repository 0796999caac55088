// Boost.JSON compiled into the library (its header-only mode: one translation
// unit), for the judge's verdicts and, through the library, the tools' reports
// and file headers.
#include <boost/json/src.hpp>
