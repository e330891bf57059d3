# glm_schema.hpp, the C++ side of oracle/schema.py (engine config fields, stages, tensor roles),
# generated into the build folder by tools/gen_headers.py with the build's Python, and regenerated
# whenever the schema or the modules it reads change. Included by the root CMakeLists.txt and by the
# emulation build (bindings/cuda/emu); glm_use_schema(target) makes a target wait for the header and
# see it.
#   in: GLM_SCHEMA_ROOT (the repository root), Python_EXECUTABLE
set(GLM_SCHEMA_DIR "${CMAKE_BINARY_DIR}/generated")
set(GLM_SCHEMA_HEADER "${GLM_SCHEMA_DIR}/glm_schema.hpp")
add_custom_command(
  OUTPUT "${GLM_SCHEMA_HEADER}"
  COMMAND "${Python_EXECUTABLE}" "${GLM_SCHEMA_ROOT}/tools/gen_headers.py" "${GLM_SCHEMA_HEADER}"
  DEPENDS "${GLM_SCHEMA_ROOT}/tools/gen_headers.py" "${GLM_SCHEMA_ROOT}/oracle/schema.py"
          "${GLM_SCHEMA_ROOT}/oracle/config.py" "${GLM_SCHEMA_ROOT}/oracle/names.py"
  COMMENT "Generating glm_schema.hpp from oracle/schema.py"
  VERBATIM)
add_custom_target(glm_schema DEPENDS "${GLM_SCHEMA_HEADER}")

function(glm_use_schema target)
  add_dependencies(${target} glm_schema)
  target_include_directories(${target} PRIVATE "${GLM_SCHEMA_DIR}")
endfunction()
