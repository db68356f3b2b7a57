# The man page (help2man over `bertrain --help`, with every command's --help as a section) and the
# bash completion (commands and each command's flags), both made from the built binary, so they
# say what the binary says.
#   cmake -DBERTRAIN=build/bertrain -DOUT=build/share -DSRC=. -P cmake/man_and_completion.cmake
execute_process(COMMAND ${BERTRAIN} --help OUTPUT_VARIABLE top RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BERTRAIN} --help failed (${rc})")
endif()
# The commands: the lines under "Subcommands:", first word of each.
string(REGEX REPLACE ".*\nSubcommands:\n" "" block "${top}")
string(REPLACE "\n" ";" lines "${block}")
set(commands)
foreach(line ${lines})
  if(line MATCHES "^  ([a-z][a-z0-9-]*) ")
    list(APPEND commands ${CMAKE_MATCH_1})
  endif()
endforeach()
if(NOT commands)
  message(FATAL_ERROR "no commands found in `${BERTRAIN} --help`")
endif()

# --- the man page: help2man's page of the top-level help, one subsection per command ----------
find_program(HELP2MAN help2man REQUIRED)
file(MAKE_DIRECTORY ${OUT}/man/man1 ${OUT}/bash-completion/completions)
set(include "[COMMANDS]\nEach command's own help (\\fBbertrain\\fR \\fIcommand\\fR \\fB--help\\fR):\n")
set(cases "")
foreach(c ${commands})
  execute_process(COMMAND ${BERTRAIN} ${c} --help OUTPUT_VARIABLE help RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${BERTRAIN} ${c} --help failed (${rc})")
  endif()
  # roff: a backslash is \e; a line starting with . or ' would be a request
  string(REPLACE "\\" "\\e" help "${help}")
  string(REGEX REPLACE "(^|\n)([.'])" "\\1\\\\&\\2" help "${help}")
  string(APPEND include ".SS ${c}\n.nf\n${help}.fi\n")
  string(REGEX MATCHALL "--[a-z0-9][a-z0-9-]*" flags "${help}")
  list(REMOVE_DUPLICATES flags)
  list(JOIN flags " " flags)
  string(APPEND cases "    ${c}) flags='${flags}' ;;\n")
endforeach()
string(APPEND include "[FILES]\n.TP\n/usr/share/bertrain/configs\nModel configurations (BERT-tiny to BERT-Large) for \\fB--model-config\\fR.\n"
       ".TP\n/usr/share/bertrain/jobs\nJob descriptions for \\fBbertrain launch\\fR.\n"
       "[SEE ALSO]\nThe documentation: https://github.com/bertrain/bertrain/tree/main/docs\n")
file(WRITE ${OUT}/bertrain.h2m "${include}")
execute_process(
  COMMAND ${HELP2MAN} --no-info --section=1 --name "pre-train and fine-tune BERT fast"
          --include ${OUT}/bertrain.h2m --output ${OUT}/man/man1/bertrain.1 ${BERTRAIN}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "help2man failed (${rc})")
endif()
# Debian installs man pages gzipped (-n: no name or time stamp in the header, the same bytes each build)
execute_process(COMMAND gzip -9nf ${OUT}/man/man1/bertrain.1 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gzip of the man page failed (${rc})")
endif()

# --- bash completion -----------------------------------------------------------------------
list(JOIN commands " " command_words)
configure_file(${SRC}/packaging/bertrain.bash.in ${OUT}/bash-completion/completions/bertrain @ONLY)
