// Boost.JSON compiled into the tool (header-only mode: one translation unit).
#include <boost/json/src.hpp>
