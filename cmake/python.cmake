# MOECERT_PYTHON: a Python 3 interpreter that imports torch, numpy and pytest
# (empty if none). Debian's /usr/bin/python3 first: a `python3` on PATH can be
# another interpreter without Debian's packages.
set(MOECERT_PYTHON "" CACHE FILEPATH "Python interpreter for the Python package's tests (torch, numpy, pytest)")
if(NOT MOECERT_PYTHON)
  find_program(_moecert_path_python3 python3)
  foreach(candidate /usr/bin/python3 ${_moecert_path_python3})
    if(EXISTS "${candidate}")
      execute_process(COMMAND ${candidate} -c "import torch, numpy, pytest" RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET)
      if(_rc EQUAL 0)
        set(MOECERT_PYTHON ${candidate} CACHE FILEPATH "Python interpreter for the Python package's tests" FORCE)
        break()
      endif()
    endif()
  endforeach()
  if(NOT MOECERT_PYTHON)
    message(WARNING "moecert: no Python 3 that imports torch, numpy and pytest (run scripts/bootstrap.sh)")
  endif()
endif()
